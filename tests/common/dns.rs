//! A dnsmasq name server in a namespace and a minimal DNS client.

use std::fs;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

use nix::sys::signal::Signal;

use super::*;

/// DNS record type A.
pub const QTYPE_A: u16 = 1;
/// DNS record type AAAA.
pub const QTYPE_AAAA: u16 = 28;

/// A dnsmasq in a namespace, answering for `*.DOMAIN` from a hosts file only (`--local=/DOMAIN/`:
/// a name missing from the file is NXDOMAIN, never forwarded). Runs as root (so it can read its
/// files), in the foreground, logging every query to its stderr. Stopped on drop.
pub struct Dnsmasq {
    ns_name: String,
    listen: IpAddr,
    domain: String,
    dir: TempDir,
    proc: Option<Proc>,
    /// Log files of earlier runs (stopped and started again).
    old_logs: Vec<String>,
}

impl Dnsmasq {
    /// Starts dnsmasq on `listen`:53 (the address must already be on an interface of `ns`)
    /// serving `hosts` (hosts-file lines) for `domain`, and waits until it answers.
    pub fn start(ns: &Netns, listen: IpAddr, domain: &str, hosts: &str) -> Dnsmasq {
        let dir = TempDir::new(&format!("dnsmasq-{}", ns.name()));
        dir.write("hosts", hosts);
        let mut d = Dnsmasq {
            ns_name: ns.name().to_string(),
            listen,
            domain: domain.to_string(),
            dir,
            proc: None,
            old_logs: vec![],
        };
        d.start_again();
        d
    }

    /// The `host:53` address clients query.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::new(self.listen, 53)
    }

    /// Starts the server again after [`Dnsmasq::stop`] (same address, same hosts file).
    pub fn start_again(&mut self) {
        assert!(self.proc.is_none(), "dnsmasq is already running");
        let hosts = self.dir.path().join("hosts");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns_name, "dnsmasq"]).args([
            "--conf-file=/dev/null".to_string(),
            "--user=root".to_string(),
            "--no-daemon".to_string(),
            "--no-resolv".to_string(),
            "--no-hosts".to_string(),
            "--port=53".to_string(),
            format!("--listen-address={}", self.listen),
            "--bind-interfaces".to_string(),
            format!("--addn-hosts={}", hosts.display()),
            format!("--local=/{}/", self.domain),
            "--log-queries".to_string(),
            "--log-facility=-".to_string(),
        ]);
        let label = format!("dnsmasq-{}", COUNTER.fetch_add(1, Ordering::Relaxed));
        let mut proc = Proc::spawn(cmd, &label, self.dir.path());
        let probe = format!("probe.{}", self.domain);
        let up = poll_until(Duration::from_secs(10), || {
            !proc.is_running() || dns_query_in(&self.ns_name, self.addr(), &probe, QTYPE_A).is_ok()
        });
        if !up || !proc.is_running() {
            let _ = proc.kill9();
            panic!(
                "dnsmasq on {} did not answer (exited: {:?}); stderr:\n{}",
                self.addr(),
                proc.try_wait(),
                proc.stderr()
            );
        }
        self.proc = Some(proc);
    }

    /// SIGTERM and wait: queries go unanswered (ICMP port unreachable) until started again.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.sigterm(Duration::from_secs(5));
            self.old_logs.push(p.stderr());
        }
    }

    /// Replaces the hosts file and tells dnsmasq to re-read it (SIGHUP); returns once a query for
    /// `name` answers `expect` (A and AAAA together, any order).
    pub fn set_hosts(&mut self, hosts: &str, name: &str, expect: &[IpAddr]) {
        self.dir.write("hosts.new", hosts);
        fs::rename(
            self.dir.path().join("hosts.new"),
            self.dir.path().join("hosts"),
        )
        .expect("rename hosts file");
        if let Some(p) = self.proc.as_mut() {
            p.signal(Signal::SIGHUP);
        }
        let mut want: Vec<IpAddr> = expect.to_vec();
        want.sort();
        let mut last = String::new();
        let ok = poll_until(Duration::from_secs(10), || {
            match dns_lookup_in(&self.ns_name, self.addr(), name) {
                Ok(got) if got == want => true,
                Ok(got) => {
                    last = format!("{got:?}");
                    false
                }
                Err(e) => {
                    last = e;
                    false
                }
            }
        });
        assert!(
            ok,
            "dnsmasq does not answer {want:?} for {name} (last: {last}); log:\n{}",
            self.logs()
        );
    }

    /// Everything dnsmasq logged (every run so far).
    pub fn logs(&self) -> String {
        let mut s = self.old_logs.join("");
        if let Some(p) = &self.proc {
            s.push_str(&p.stderr());
        }
        s
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        if let Some(p) = self.proc.as_mut() {
            p.stop_quietly(Duration::from_secs(3));
        }
    }
}

/// One DNS answer: the response code (0 NOERROR, 3 NXDOMAIN, ...) and the A/AAAA addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsAnswer {
    pub rcode: u8,
    pub addrs: Vec<IpAddr>,
}

/// Asks `server` (UDP, 2 s) for `name`/`qtype` from inside namespace `ns_name`.
pub fn dns_query_in(
    ns_name: &str,
    server: SocketAddr,
    name: &str,
    qtype: u16,
) -> Result<DnsAnswer, String> {
    let nspath = PathBuf::from(format!("/var/run/netns/{ns_name}"));
    let name = name.to_string();
    std::thread::spawn(move || {
        enter_ns(&nspath);
        dns_query(server, &name, qtype)
    })
    .join()
    .map_err(|_| "dns query thread panicked".to_string())?
}

/// A and AAAA of `name`, sorted; `Err` unless both queries answer NOERROR.
pub fn dns_lookup_in(ns_name: &str, server: SocketAddr, name: &str) -> Result<Vec<IpAddr>, String> {
    let mut all = Vec::new();
    for qtype in [QTYPE_A, QTYPE_AAAA] {
        let a = dns_query_in(ns_name, server, name, qtype)?;
        if a.rcode != 0 {
            return Err(format!("{name} type {qtype}: rcode {}", a.rcode));
        }
        all.extend(a.addrs);
    }
    all.sort();
    Ok(all)
}

/// A minimal DNS client over UDP from the calling thread's namespace.
pub fn dns_query(server: SocketAddr, name: &str, qtype: u16) -> Result<DnsAnswer, String> {
    let id: u16 = (std::process::id() as u16) ^ (COUNTER.fetch_add(1, Ordering::Relaxed) as u16);
    let mut q = Vec::with_capacity(64);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]); // RD; one question
    for label in name.trim_end_matches('.').split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.push(0);
    q.extend_from_slice(&qtype.to_be_bytes());
    q.extend_from_slice(&1u16.to_be_bytes()); // IN
    let bind: SocketAddr = if server.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let s = UdpSocket::bind(bind).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    s.send_to(&q, server)
        .map_err(|e| format!("{server}: {e}"))?;
    let mut buf = [0u8; 4096];
    let n = loop {
        let (n, from) = s
            .recv_from(&mut buf)
            .map_err(|e| format!("{server}: {e}"))?;
        if from == server && n >= 12 && buf[..2] == id.to_be_bytes() {
            break n;
        }
    };
    parse_dns_answer(&buf[..n])
}

fn parse_dns_answer(m: &[u8]) -> Result<DnsAnswer, String> {
    let short = || "short DNS message".to_string();
    let u16_at = |i: usize| -> Result<u16, String> {
        Ok(u16::from_be_bytes([
            *m.get(i).ok_or_else(short)?,
            *m.get(i + 1).ok_or_else(short)?,
        ]))
    };
    // Skips a (possibly compressed) name starting at i; returns the offset after it.
    let skip_name = |mut i: usize| -> Result<usize, String> {
        loop {
            let len = *m.get(i).ok_or_else(short)?;
            if len & 0xc0 == 0xc0 {
                return Ok(i + 2);
            }
            if len == 0 {
                return Ok(i + 1);
            }
            i += 1 + len as usize;
        }
    };
    let rcode = m.get(3).ok_or_else(short)? & 0x0f;
    let qd = u16_at(4)?;
    let an = u16_at(6)?;
    let mut i = 12;
    for _ in 0..qd {
        i = skip_name(i)? + 4;
    }
    let mut addrs = Vec::new();
    for _ in 0..an {
        i = skip_name(i)?;
        let rtype = u16_at(i)?;
        let rdlen = u16_at(i + 8)? as usize;
        let data = m.get(i + 10..i + 10 + rdlen).ok_or_else(short)?;
        match (rtype, rdlen) {
            (QTYPE_A, 4) => addrs.push(IpAddr::from(
                <[u8; 4]>::try_from(data).map_err(|_| short())?,
            )),
            (QTYPE_AAAA, 16) => addrs.push(IpAddr::from(
                <[u8; 16]>::try_from(data).map_err(|_| short())?,
            )),
            _ => {}
        }
        i += 10 + rdlen;
    }
    Ok(DnsAnswer { rcode, addrs })
}
