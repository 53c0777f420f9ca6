//! The inner traffic: an IPv4 ICMP echo request from a peer's tunnel address to the gateway's,
//! carrying its send time and the peer's number, and the parse of the echo reply that proves
//! the session works both ways. Pure: built into and parsed from the caller's buffers.

use std::net::Ipv4Addr;

const IPV4_HEADER: usize = 20;
const ICMP_HEADER: usize = 8;
/// Payload: send time (CLOCK_MONOTONIC ns, u64 LE), peer number (u32 LE), [`MAGIC`].
const PAYLOAD: usize = 16;
/// An echo request's full length, IPv4 header included.
pub const ECHO_LEN: usize = IPV4_HEADER + ICMP_HEADER + PAYLOAD;
const MAGIC: u32 = 0x7467_7073; // "tgps"
const PROTO_ICMP: u8 = 1;
const ECHO_REQUEST: u8 = 8;
const ECHO_REPLY: u8 = 0;

/// What an echo reply carried back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Echo {
    pub seq: u16,
    pub sent_ns: u64,
    pub peer: u32,
}

/// The Internet checksum (RFC 1071) of `data`.
pub fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The ICMP identifier of peer `peer`'s echoes.
pub fn echo_id(peer: u32) -> u16 {
    (peer & 0xffff) as u16
}

/// Writes an echo request from `src` to `dst` into `buf`.
pub fn build_echo(
    buf: &mut [u8; ECHO_LEN],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    peer: u32,
    seq: u16,
    sent_ns: u64,
) {
    let (ip, icmp) = buf.split_at_mut(IPV4_HEADER);
    ip[0] = 0x45;
    ip[1] = 0;
    ip[2..4].copy_from_slice(&(ECHO_LEN as u16).to_be_bytes());
    ip[4..6].copy_from_slice(&seq.to_be_bytes());
    ip[6..8].copy_from_slice(&[0x40, 0]); // don't fragment
    ip[8] = 64;
    ip[9] = PROTO_ICMP;
    ip[10..12].copy_from_slice(&[0, 0]);
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let c = checksum(ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());

    icmp[0] = ECHO_REQUEST;
    icmp[1] = 0;
    icmp[2..4].copy_from_slice(&[0, 0]);
    icmp[4..6].copy_from_slice(&echo_id(peer).to_be_bytes());
    icmp[6..8].copy_from_slice(&seq.to_be_bytes());
    icmp[8..16].copy_from_slice(&sent_ns.to_le_bytes());
    icmp[16..20].copy_from_slice(&peer.to_le_bytes());
    icmp[20..24].copy_from_slice(&MAGIC.to_le_bytes());
    let c = checksum(icmp);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
}

/// The echo reply in `packet` from `from` to `to`, if it is one of ours: IPv4, ICMP echo reply
/// with valid checksums, our magic, for peer `peer`. `None` for anything else.
pub fn parse_echo_reply(packet: &[u8], from: Ipv4Addr, to: Ipv4Addr, peer: u32) -> Option<Echo> {
    let first = *packet.first()?;
    if first >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(first & 0x0f) * 4;
    if ihl < IPV4_HEADER || packet.len() < ihl {
        return None;
    }
    let total = usize::from(u16::from_be_bytes([*packet.get(2)?, *packet.get(3)?]));
    if total < ihl + ICMP_HEADER + PAYLOAD || total > packet.len() {
        return None;
    }
    let ip = &packet[..ihl];
    if ip[9] != PROTO_ICMP
        || checksum(ip) != 0
        || ip[12..16] != from.octets()
        || ip[16..20] != to.octets()
    {
        return None;
    }
    let icmp = &packet[ihl..total];
    if icmp[0] != ECHO_REPLY || icmp[1] != 0 || checksum(icmp) != 0 {
        return None;
    }
    let word = |at: usize| -> Option<[u8; 4]> { icmp.get(at..at + 4)?.try_into().ok() };
    let id = u16::from_be_bytes([icmp[4], icmp[5]]);
    let seq = u16::from_be_bytes([icmp[6], icmp[7]]);
    let sent_ns = u64::from_le_bytes(icmp.get(8..16)?.try_into().ok()?);
    let who = u32::from_le_bytes(word(16)?);
    if u32::from_le_bytes(word(20)?) != MAGIC || who != peer || id != echo_id(peer) {
        return None;
    }
    Some(Echo {
        seq,
        sent_ns,
        peer: who,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PEER: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 7);
    const GW: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 1);

    /// What a host's kernel answers: the addresses swapped, type 0, both checksums redone.
    fn reply_to(request: &[u8]) -> Vec<u8> {
        let mut r = request.to_vec();
        r[12..16].copy_from_slice(&request[16..20]);
        r[16..20].copy_from_slice(&request[12..16]);
        r[8] = 63;
        r[10..12].copy_from_slice(&[0, 0]);
        let c = checksum(&r[..20]);
        r[10..12].copy_from_slice(&c.to_be_bytes());
        r[20] = ECHO_REPLY;
        r[22..24].copy_from_slice(&[0, 0]);
        let c = checksum(&r[20..]);
        r[22..24].copy_from_slice(&c.to_be_bytes());
        r
    }

    #[test]
    fn checksum_matches_rfc1071_example() {
        // RFC 1071 section 3's example words sum to 0xddf2 (one's complement: 0x220d).
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(checksum(&data), !0xddf2);
        // Odd length: the last byte is the high half of a word.
        assert_eq!(checksum(&[0x01]), !0x0100);
    }

    #[test]
    fn request_is_valid_ipv4_icmp() {
        let mut buf = [0u8; ECHO_LEN];
        build_echo(&mut buf, PEER, GW, 70_000, 9, 123_456_789);
        assert_eq!(buf[0], 0x45);
        assert_eq!(u16::from_be_bytes([buf[2], buf[3]]) as usize, ECHO_LEN);
        assert_eq!(checksum(&buf[..20]), 0);
        assert_eq!(checksum(&buf[20..]), 0);
        assert_eq!(buf[20], ECHO_REQUEST);
        assert_eq!(u16::from_be_bytes([buf[24], buf[25]]), echo_id(70_000));
        // The fork's own check of an inner packet accepts it, from the peer's address.
        assert_eq!(
            boringtun::noise::Tunn::inner_packet(&buf),
            Ok(boringtun::noise::Inner::Packet(ECHO_LEN, PEER.into()))
        );
    }

    #[test]
    fn reply_round_trips() {
        let mut buf = [0u8; ECHO_LEN];
        build_echo(&mut buf, PEER, GW, 70_000, 9, 123_456_789);
        let reply = reply_to(&buf);
        assert_eq!(
            parse_echo_reply(&reply, GW, PEER, 70_000),
            Some(Echo {
                seq: 9,
                sent_ns: 123_456_789,
                peer: 70_000
            })
        );
        // Trailing padding after the IP packet is ignored.
        let mut padded = reply.clone();
        padded.extend_from_slice(&[0; 4]);
        assert!(parse_echo_reply(&padded, GW, PEER, 70_000).is_some());
    }

    #[test]
    fn foreign_or_broken_replies_are_refused() {
        let mut buf = [0u8; ECHO_LEN];
        build_echo(&mut buf, PEER, GW, 5, 1, 42);
        let reply = reply_to(&buf);
        // another peer's, from elsewhere, to elsewhere
        assert_eq!(parse_echo_reply(&reply, GW, PEER, 6), None);
        assert_eq!(parse_echo_reply(&reply, PEER, PEER, 5), None);
        assert_eq!(parse_echo_reply(&reply, GW, GW, 5), None);
        // the request itself (type 8) is no reply
        assert_eq!(parse_echo_reply(&buf, PEER, GW, 5), None);
        // any flipped byte breaks a checksum or a field
        for i in 0..reply.len() {
            let mut bad = reply.clone();
            bad[i] ^= 0x10;
            assert_eq!(parse_echo_reply(&bad, GW, PEER, 5), None, "byte {i}");
        }
        // truncated at every length
        for n in 0..reply.len() {
            assert_eq!(
                parse_echo_reply(&reply[..n], GW, PEER, 5),
                None,
                "length {n}"
            );
        }
        assert_eq!(parse_echo_reply(&[], GW, PEER, 5), None);
    }
}
