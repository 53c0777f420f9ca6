//! Unit tests of TUN offload framing: segments are valid packets, and coalescing undoes
//! splitting without reordering a connection.

use super::*;

const A4: [u8; 4] = [100, 64, 0, 1];
const B4: [u8; 4] = [100, 64, 0, 2];

fn payload(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// An IPv4 or IPv6 TCP packet (timestamps option) or UDP packet with a valid checksum.
fn packet(v6: bool, proto: u8, sport: u16, seq: u32, flags: u8, data: &[u8]) -> Vec<u8> {
    let ip_len = if v6 { 40 } else { 20 };
    let l4_len = if proto == PROTO_TCP { 32 } else { 8 };
    let total = ip_len + l4_len + data.len();
    let mut p = vec![0u8; total];
    if v6 {
        p[0] = 0x60;
        p[4..6].copy_from_slice(&((total - 40) as u16).to_be_bytes());
        p[6] = proto;
        p[7] = 64;
        p[8..24].copy_from_slice(&[0xfd, 0x7a, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        p[24..40].copy_from_slice(&[0xfd, 0x7a, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
    } else {
        p[0] = 0x45;
        p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        p[4..6].copy_from_slice(&7u16.to_be_bytes());
        p[6] = 0x40; // DF
        p[8] = 64;
        p[9] = proto;
        p[12..16].copy_from_slice(&A4);
        p[16..20].copy_from_slice(&B4);
        ipv4_header_checksum(&mut p, 20);
    }
    let t = ip_len;
    p[t..t + 2].copy_from_slice(&sport.to_be_bytes());
    p[t + 2..t + 4].copy_from_slice(&5201u16.to_be_bytes());
    if proto == PROTO_TCP {
        p[t + 4..t + 8].copy_from_slice(&seq.to_be_bytes());
        p[t + 8..t + 12].copy_from_slice(&99u32.to_be_bytes());
        p[t + 12] = 8 << 4;
        p[t + 13] = flags;
        p[t + 14..t + 16].copy_from_slice(&512u16.to_be_bytes());
        p[t + 20..t + 32].copy_from_slice(&[1, 1, 8, 10, 0, 0, 0, 5, 0, 0, 0, 9]);
    } else {
        p[t + 4..t + 6].copy_from_slice(&((total - t) as u16).to_be_bytes());
    }
    p[ip_len + l4_len..].copy_from_slice(data);
    let layout = Layout::parse(&p).expect("test packet parses");
    let at = layout.checksum_offset();
    let c = !fold(sum16(&p[t..], pseudo_sum(&p, v6, proto, total - t)));
    p[at..at + 2].copy_from_slice(&c.to_be_bytes());
    p
}

/// Checks the IPv4 header checksum and the transport checksum of a complete packet.
fn assert_valid(p: &[u8]) {
    let l = Layout::parse(p).expect("valid packet parses");
    if !l.v6 {
        assert_eq!(fold(sum16(&p[..20], 0)), 0xffff, "IPv4 header checksum");
        assert_eq!(usize::from(u16::from_be_bytes([p[2], p[3]])), p.len());
    } else {
        assert_eq!(usize::from(u16::from_be_bytes([p[4], p[5]])), p.len() - 40);
    }
    let sum = sum16(
        &p[l.ip_len..],
        pseudo_sum(p, l.v6, l.proto, p.len() - l.ip_len),
    );
    assert_eq!(fold(sum), 0xffff, "transport checksum");
}

/// A TUN read: virtio header for TSO/USO, then the super-packet with a partial checksum.
fn super_read(v6: bool, proto: u8, mss: u16, data: &[u8]) -> Vec<u8> {
    let mut p = packet(v6, proto, 40000, 1000, TCP_ACK | TCP_PSH, data);
    let l = Layout::parse(&p).expect("parses");
    let at = l.checksum_offset();
    let pseudo = fold(pseudo_sum(&p, v6, proto, p.len() - l.ip_len));
    p[at..at + 2].copy_from_slice(&pseudo.to_be_bytes());
    let mut read = vec![0u8; VNET_HDR_LEN];
    VnetHdr {
        flags: F_NEEDS_CSUM,
        gso_type: match (proto, v6) {
            (PROTO_UDP, _) => GSO_UDP_L4,
            (_, false) => GSO_TCPV4,
            (_, true) => GSO_TCPV6,
        },
        hdr_len: l.headers() as u16,
        gso_size: mss,
        csum_start: l.ip_len as u16,
        csum_offset: (at - l.ip_len) as u16,
    }
    .encode(&mut read);
    read.extend_from_slice(&p);
    read
}

fn split_all(read: &mut [u8]) -> Vec<Vec<u8>> {
    let plan = plan_split(read).expect("splits");
    (0..plan.count())
        .map(|i| {
            let r = plan.segment(read, i);
            read[r].to_vec()
        })
        .collect()
}

/// Feeds packets through the coalescer as the receive loop does; returns the TUN writes.
fn coalesce(c: &mut Coalescer, packets: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut writes = Vec::new();
    for p in packets {
        if c.needs_drain() {
            c.drain(|w| writes.push(w.to_vec()));
        }
        // A datagram is 32 bytes longer than its plaintext; the cipher writes that far.
        let land = c.landing(p.len() + 32);
        land[..p.len() + 16].fill(0xee);
        land[..p.len()].copy_from_slice(p);
        c.commit(p.len());
    }
    c.drain(|w| writes.push(w.to_vec()));
    writes
}

#[test]
fn tso_read_splits_into_valid_segments_with_advancing_sequence() {
    let data = payload(10_000, 3);
    let mut read = super_read(false, PROTO_TCP, 1380, &data);
    let segs = split_all(&mut read);
    assert_eq!(segs.len(), 8);
    let mut joined = Vec::new();
    for (i, s) in segs.iter().enumerate() {
        assert_valid(s);
        let l = Layout::parse(s).expect("parses");
        assert_eq!(tcp_seq(s, &l), 1000 + (i * 1380) as u32);
        assert_eq!(u16::from_be_bytes([s[4], s[5]]), 7 + i as u16, "IPv4 id");
        let psh = s[l.ip_len + 13] & TCP_PSH != 0;
        assert_eq!(psh, i == 7, "PSH only on the last segment");
        joined.extend_from_slice(&s[l.headers()..]);
    }
    assert_eq!(joined, data);
}

#[test]
fn segments_made_into_their_own_slots_in_any_order_equal_those_made_in_place() {
    for (v6, proto) in [(false, PROTO_TCP), (true, PROTO_TCP), (false, PROTO_UDP)] {
        let data = payload(9_000, 5);
        let read = super_read(v6, proto, 1300, &data);
        let in_place = split_all(&mut read.clone());
        let plan = plan_split(&mut read.clone()).expect("splits");
        let mut made = vec![Vec::new(); plan.count()];
        // Last to first: nothing depends on the previous segment's bytes.
        for i in (0..plan.count()).rev() {
            let mut slot = vec![0u8; 2048];
            let len = plan.segment_into(&read, i, &mut slot);
            made[i] = slot[..len].to_vec();
        }
        assert_eq!(made, in_place, "v6 {v6} proto {proto}");
        assert_eq!(
            plan.plaintext_bytes(),
            in_place.iter().map(Vec::len).sum::<usize>()
        );
    }
    // A read that is not split is copied whole.
    let mut read = vec![0u8; VNET_HDR_LEN];
    read.extend_from_slice(&packet(false, PROTO_UDP, 1, 1, 0, &payload(100, 1)));
    let plan = plan_split(&mut read).expect("whole");
    let mut slot = vec![0u8; 2048];
    let len = plan.segment_into(&read, 0, &mut slot);
    assert_eq!(slot[..len], read[VNET_HDR_LEN..]);
    assert_eq!(plan.plaintext_bytes(), len);
}

#[test]
fn coalescing_undoes_splitting_for_tcp_over_ipv4_and_ipv6() {
    for v6 in [false, true] {
        let data = payload(50_000, 9);
        let mut read = super_read(v6, PROTO_TCP, 1368, &data);
        let original = split_all(&mut read.clone());
        let segs = split_all(&mut read);
        let mut c = Coalescer::new(8, true);
        let writes = coalesce(&mut c, &segs);
        assert_eq!(writes.len(), 1, "one TUN write for one flow");
        let hdr = VnetHdr::decode(&writes[0]).expect("has a header");
        assert_eq!(hdr.gso_type, if v6 { GSO_TCPV6 } else { GSO_TCPV4 });
        assert_eq!(hdr.gso_size, 1368);
        assert_eq!(hdr.flags, F_NEEDS_CSUM);
        // The write splits again into exactly the segments that went in.
        let mut again = writes[0].clone();
        assert_eq!(split_all(&mut again), original);
    }
}

#[test]
fn interleaved_connections_each_become_one_write_in_order() {
    let a = payload(1300, 1);
    let b = payload(1300, 2);
    let mut packets = Vec::new();
    for i in 0..6u32 {
        packets.push(packet(false, PROTO_TCP, 1111, 1300 * i, TCP_ACK, &a));
        packets.push(packet(false, PROTO_TCP, 2222, 1300 * i, TCP_ACK, &b));
    }
    let writes = coalesce(&mut Coalescer::new(8, true), &packets);
    assert_eq!(writes.len(), 2);
    for (w, port) in writes.iter().zip([1111u16, 2222]) {
        let mut again = w.clone();
        let segs = split_all(&mut again);
        assert_eq!(segs.len(), 6);
        for s in &segs {
            assert_eq!(u16::from_be_bytes([s[20], s[21]]), port);
        }
    }
}

#[test]
fn a_gap_in_the_sequence_starts_a_new_write_after_the_first() {
    let d = payload(1000, 4);
    let packets = vec![
        packet(false, PROTO_TCP, 1, 0, TCP_ACK, &d),
        packet(false, PROTO_TCP, 1, 1000, TCP_ACK, &d),
        packet(false, PROTO_TCP, 1, 5000, TCP_ACK, &d),
        packet(false, PROTO_TCP, 1, 6000, TCP_ACK, &d),
        // A retransmission of the start must not join the earlier write either.
        packet(false, PROTO_TCP, 1, 2000, TCP_ACK, &d),
    ];
    let writes = coalesce(&mut Coalescer::new(8, true), &packets);
    let seqs: Vec<Vec<u32>> = writes
        .iter()
        .map(|w| {
            split_all(&mut w.clone())
                .iter()
                .map(|s| tcp_seq(s, &Layout::parse(s).expect("parses")))
                .collect()
        })
        .collect();
    assert_eq!(seqs, vec![vec![0, 1000], vec![5000, 6000], vec![2000]]);
}

#[test]
fn a_packet_without_payload_is_not_overtaken_by_later_data() {
    let d = payload(1000, 5);
    let packets = vec![
        packet(false, PROTO_TCP, 1, 0, TCP_ACK, &d),
        packet(false, PROTO_TCP, 1, 1000, TCP_ACK, &[]),
        packet(false, PROTO_TCP, 1, 1000, TCP_ACK, &d),
    ];
    let writes = coalesce(&mut Coalescer::new(8, true), &packets);
    assert_eq!(writes.len(), 3);
    for (w, p) in writes.iter().zip(&packets) {
        assert_eq!(&w[VNET_HDR_LEN..], &p[..], "written alone, unchanged");
        assert_eq!(
            VnetHdr::decode(w).expect("has a header"),
            VnetHdr::default()
        );
    }
}

#[test]
fn psh_and_short_segments_end_a_write() {
    let d = payload(1000, 6);
    let packets = vec![
        packet(false, PROTO_TCP, 1, 0, TCP_ACK, &d),
        packet(false, PROTO_TCP, 1, 1000, TCP_ACK | TCP_PSH, &d),
        packet(false, PROTO_TCP, 1, 2000, TCP_ACK, &d),
        packet(false, PROTO_TCP, 1, 3000, TCP_ACK, &d[..500]),
        packet(false, PROTO_TCP, 1, 3500, TCP_ACK, &d[..500]),
    ];
    let writes = coalesce(&mut Coalescer::new(8, true), &packets);
    assert_eq!(writes.len(), 3);
    let first = &writes[0][VNET_HDR_LEN..];
    assert_ne!(
        first[20 + 13] & TCP_PSH,
        0,
        "the write carries its last segment's PSH"
    );
    assert_eq!(
        VnetHdr::decode(&writes[2]).expect("has a header"),
        VnetHdr::default()
    );
}

#[test]
fn udp_is_coalesced_only_when_the_device_takes_uso() {
    let d = payload(1200, 7);
    let packets: Vec<Vec<u8>> = (0..5)
        .map(|_| packet(true, PROTO_UDP, 9, 0, 0, &d))
        .collect();
    let singles = coalesce(&mut Coalescer::new(8, false), &packets);
    assert_eq!(singles.len(), 5);
    let merged = coalesce(&mut Coalescer::new(8, true), &packets);
    assert_eq!(merged.len(), 1);
    assert_eq!(
        VnetHdr::decode(&merged[0]).expect("has a header").gso_type,
        GSO_UDP_L4
    );
    let segs = split_all(&mut merged[0].clone());
    assert_eq!(segs, packets);
}

#[test]
fn abandoning_a_landing_restores_the_payload_beneath_it() {
    let d = payload(1000, 8);
    let mut c = Coalescer::new(4, true);
    let first = packet(false, PROTO_TCP, 1, 0, TCP_ACK, &d);
    let mut second = packet(false, PROTO_TCP, 1, 1000, TCP_ACK, &d);
    second[5] = 8; // the IPv4 id a split gives the second segment
    ipv4_header_checksum(&mut second, 20);
    let land = c.landing(first.len() + 32);
    land[..first.len()].copy_from_slice(&first);
    c.commit(first.len());
    // A handshake message lands where the next segment would and is answered, not written.
    c.landing(200)[..200].fill(0x55);
    c.abandon();
    let land = c.landing(second.len() + 32);
    land[..second.len()].copy_from_slice(&second);
    c.commit(second.len());
    let mut writes = Vec::new();
    c.drain(|w| writes.push(w.to_vec()));
    assert!(
        split_all(&mut writes[0].clone()) == vec![first, second],
        "payload intact"
    );
}

#[test]
fn a_full_coalescer_asks_to_be_drained_and_loses_nothing() {
    let packets: Vec<Vec<u8>> = (0..10)
        .map(|i| {
            let mut p = packet(false, PROTO_UDP, 0, 0, 0, &payload(100, i));
            p[9] = 1; // ICMP: never merged
            p
        })
        .collect();
    let writes = coalesce(&mut Coalescer::new(3, true), &packets);
    let bodies: Vec<Vec<u8>> = writes.iter().map(|w| w[VNET_HDR_LEN..].to_vec()).collect();
    assert_eq!(bodies, packets);
}

#[test]
fn a_partial_checksum_without_gso_is_completed() {
    let mut read = super_read(false, PROTO_TCP, 1400, &payload(300, 1));
    let mut hdr = VnetHdr::decode(&read).expect("has a header");
    hdr.gso_type = GSO_NONE;
    hdr.encode(&mut read);
    let plan = plan_split(&mut read).expect("splits");
    assert_eq!(plan.count(), 1);
    let r = plan.segment(&mut read, 0);
    assert_valid(&read[r]);
}

#[test]
fn malformed_reads_are_refused() {
    assert_eq!(
        plan_split(&mut [0u8; 4]).expect_err("refused"),
        SplitError::NoHeader
    );
    let mut read = super_read(false, PROTO_TCP, 1400, &payload(3000, 1));
    read[1] = 3; // GSO_UDP (UFO): not produced with the offloads we enable
    assert_eq!(
        plan_split(&mut read).expect_err("refused"),
        SplitError::GsoType(3)
    );
    let mut read = super_read(false, PROTO_TCP, 1400, &payload(3000, 1));
    read[1] = GSO_TCPV6;
    assert_eq!(
        plan_split(&mut read).expect_err("refused"),
        SplitError::Malformed
    );
    let mut read = super_read(false, PROTO_TCP, 0, &payload(3000, 1));
    assert_eq!(
        plan_split(&mut read).expect_err("refused"),
        SplitError::Malformed
    );
}

#[test]
fn the_word_sum_equals_the_textbook_sum_for_every_length() {
    fn textbook(data: &[u8]) -> u16 {
        let mut sum: u32 = 0;
        for pair in data.chunks(2) {
            let hi = u32::from(pair[0]) << 8;
            sum += hi | pair.get(1).map_or(0, |&b| u32::from(b));
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        sum as u16
    }
    let data = payload(3000, 77);
    for len in (0..64).chain([1379, 1380, 1381, 2999, 3000]) {
        assert_eq!(
            fold(sum16(&data[..len], 0)),
            textbook(&data[..len]),
            "length {len}"
        );
        assert_eq!(fold(sum16(&data[..len], 0x1_2345)), {
            let t = u32::from(textbook(&data[..len])) + 0x1_2345;
            fold(u64::from(t))
        });
    }
    // All-ones data exercises the carries.
    let ones = [0xffu8; 1501];
    assert_eq!(fold(sum16(&ones, 0)), textbook(&ones));
}
