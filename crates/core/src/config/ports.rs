//! Port mappings `LISTEN[:TARGET][/tcp|/udp]`, and the pairwise overlap check between rules on one
//! address (the reference that validate.rs's indexed check is tested against).

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        })
    }
}

/// One forwarded port: traffic to `listen` goes to `target` on the target address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortMap {
    pub proto: Proto,
    pub listen: u16,
    pub target: u16,
}

impl fmt::Display for PortMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.listen == self.target {
            write!(f, "{}/{}", self.listen, self.proto)
        } else {
            write!(f, "{}:{}/{}", self.listen, self.target, self.proto)
        }
    }
}

const EXPECTED: &str =
    "expected LISTEN[:TARGET][/tcp|/udp] with ports 1-65535, like \"443:8443/tcp\"";

impl std::str::FromStr for PortMap {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (ports, proto) = match text.split_once('/') {
            None => (text, Proto::Tcp),
            Some((p, "tcp")) => (p, Proto::Tcp),
            Some((p, "udp")) => (p, Proto::Udp),
            Some((_, other)) => {
                return Err(format!(
                    "protocol \"{other}\" is not supported: expected tcp or udp"
                ))
            }
        };
        let (listen, target) = match ports.split_once(':') {
            None => (ports, ports),
            Some((l, t)) => (l, t),
        };
        let port = |s: &str| -> Result<u16, String> {
            match s.parse::<u16>() {
                Ok(0) | Err(_) => Err(EXPECTED.to_string()),
                Ok(p) => Ok(p),
            }
        };
        Ok(PortMap {
            proto,
            listen: port(listen)?,
            target: port(target)?,
        })
    }
}

/// Whether two rules on the same address claim some of the same traffic. An empty list owns
/// every port and protocol.
#[cfg(test)]
pub(super) fn overlap(a: &[PortMap], b: &[PortMap]) -> bool {
    if a.is_empty() || b.is_empty() {
        return true;
    }
    a.iter()
        .any(|x| b.iter().any(|y| x.proto == y.proto && x.listen == y.listen))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        let p: PortMap = "80".parse().expect("valid");
        assert_eq!((p.proto, p.listen, p.target), (Proto::Tcp, 80, 80));
        let p: PortMap = "443:8443".parse().expect("valid");
        assert_eq!((p.listen, p.target), (443, 8443));
        let p: PortMap = "53/udp".parse().expect("valid");
        assert_eq!((p.proto, p.listen), (Proto::Udp, 53));
        let p: PortMap = "5353:53/udp".parse().expect("valid");
        assert_eq!(p.to_string(), "5353:53/udp");
    }

    #[test]
    fn rejects_bad_ports_and_protocols() {
        for bad in ["0", "65536", "x", "80:", ":80", "80/sctp", "1-2", ""] {
            assert!(bad.parse::<PortMap>().is_err(), "{bad} accepted");
        }
        let err = "80/sctp".parse::<PortMap>().expect_err("sctp");
        assert!(err.contains("sctp") && err.contains("tcp or udp"), "{err}");
    }

    #[test]
    fn overlap_is_per_protocol_and_listen_port() {
        let p = |s: &str| s.parse::<PortMap>().expect("valid");
        assert!(overlap(&[], &[p("80")]));
        assert!(overlap(&[p("80")], &[p("80:81")]));
        assert!(!overlap(&[p("80")], &[p("80/udp")]));
        assert!(!overlap(&[p("80")], &[p("81")]));
    }
}
