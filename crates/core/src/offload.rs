//! TUN offload framing, done in place: splitting a TSO/USO super-packet read from the TUN device
//! into wire-sized segments, and coalescing decrypted segments back into super-packets for one
//! TUN write. Pure byte work on caller-owned buffers: no I/O, no allocation per packet.
//!
//! Why not tun-rs's own `recv_multiple`/`send_multiple`: they copy every segment into a
//! separate buffer (and its GRO copies each packet once more into a fresh `Vec`) and verify
//! every checksum. Here a segment is handed to the cipher straight out of the super-packet, and
//! a decrypted segment lands where it belongs in its super-packet, so the only copies left are
//! the kernel's and the cipher's.

use std::ops::Range;

/// Size of `struct virtio_net_hdr` in front of every TUN read and write with `IFF_VNET_HDR`.
pub const VNET_HDR_LEN: usize = 10;
const F_NEEDS_CSUM: u8 = 1;
const GSO_NONE: u8 = 0;
const GSO_TCPV4: u8 = 1;
const GSO_TCPV6: u8 = 4;
const GSO_UDP_L4: u8 = 5;
const GSO_ECN: u8 = 0x80;
const PROTO_TCP: u8 = 6;
const PROTO_UDP: u8 = 17;
const TCP_FIN: u8 = 0x01;
const TCP_PSH: u8 = 0x08;
const TCP_ACK: u8 = 0x10;
const TCP_CWR: u8 = 0x80;
/// Longest IP header plus transport header we split or coalesce (IPv6 + TCP with options).
const MAX_HEADERS: usize = 40 + 60;
/// At most this many segments in one coalesced write (the kernel's UDP GSO limit; TCP alike).
const MAX_SEGMENTS: u16 = 64;
/// Largest IP packet (IPv4 total length and IPv6 payload length are 16-bit).
const MAX_IP_PACKET: usize = 65535;

/// The `struct virtio_net_hdr` fields (native endian, as TUN uses without `TUNSETVNETLE`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VnetHdr {
    pub flags: u8,
    pub gso_type: u8,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
}

impl VnetHdr {
    pub fn decode(b: &[u8]) -> Option<VnetHdr> {
        let b = b.get(..VNET_HDR_LEN)?;
        let u16_at = |i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
        Some(VnetHdr {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u16_at(2),
            gso_size: u16_at(4),
            csum_start: u16_at(6),
            csum_offset: u16_at(8),
        })
    }

    pub fn encode(&self, b: &mut [u8]) {
        b[0] = self.flags;
        b[1] = self.gso_type;
        b[2..4].copy_from_slice(&self.hdr_len.to_ne_bytes());
        b[4..6].copy_from_slice(&self.gso_size.to_ne_bytes());
        b[6..8].copy_from_slice(&self.csum_start.to_ne_bytes());
        b[8..10].copy_from_slice(&self.csum_offset.to_ne_bytes());
    }
}

/// Ones' complement sum of `data` (as big-endian 16-bit words) added to `sum`, not folded.
/// Sums native-endian 32-bit words, which vectorises, and swaps once at the end: the ones'
/// complement sum is byte-order independent up to that swap (RFC 1071).
fn sum16(data: &[u8], sum: u64) -> u64 {
    let mut acc: u64 = 0;
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        acc += u64::from(u32::from_ne_bytes([w[0], w[1], w[2], w[3]]));
    }
    let mut tail = [0u8; 4];
    tail[..words.remainder().len()].copy_from_slice(words.remainder());
    acc += u64::from(u32::from_ne_bytes(tail));
    sum + u64::from(u16::from_be(fold(acc)))
}

fn fold(mut sum: u64) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// The pseudo-header sum of an IPv4 or IPv6 packet for a transport segment of `l4_len` bytes.
fn pseudo_sum(packet: &[u8], v6: bool, proto: u8, l4_len: usize) -> u64 {
    let addrs = if v6 { &packet[8..40] } else { &packet[12..20] };
    sum16(addrs, u64::from(proto) + l4_len as u64)
}

fn ipv4_header_checksum(packet: &mut [u8], ihl: usize) {
    packet[10..12].fill(0);
    let c = !fold(sum16(&packet[..ihl], 0));
    packet[10..12].copy_from_slice(&c.to_be_bytes());
}

/// Where the IP and transport headers of a packet end, for the two transports we offload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    v6: bool,
    proto: u8,
    ip_len: usize,
    l4_len: usize,
}

impl Layout {
    /// Parses an unfragmented IPv4 (no options) or IPv6 (no extension headers) TCP/UDP packet.
    fn parse(packet: &[u8]) -> Option<Layout> {
        let (v6, proto, ip_len) = match packet.first()? >> 4 {
            4 if packet.len() >= 20 && packet[0] & 0x0f == 5 => {
                // More-fragments flag or a fragment offset: not a whole datagram.
                if packet[6] & 0x3f != 0 || packet[7] != 0 {
                    return None;
                }
                (false, packet[9], 20)
            }
            6 if packet.len() >= 40 => (true, packet[6], 40),
            _ => return None,
        };
        let l4_len = match proto {
            PROTO_TCP => {
                let len = usize::from(*packet.get(ip_len + 12)? >> 4) * 4;
                if len < 20 {
                    return None;
                }
                len
            }
            PROTO_UDP => 8,
            _ => return None,
        };
        if packet.len() < ip_len + l4_len {
            return None;
        }
        Some(Layout {
            v6,
            proto,
            ip_len,
            l4_len,
        })
    }

    fn headers(&self) -> usize {
        self.ip_len + self.l4_len
    }

    fn checksum_offset(&self) -> usize {
        self.ip_len + if self.proto == PROTO_TCP { 16 } else { 6 }
    }

    /// Sets the IP length fields (and the IPv4 header checksum) for a packet of `total` bytes.
    fn set_ip_length(&self, packet: &mut [u8], total: usize) {
        if self.v6 {
            packet[4..6].copy_from_slice(&((total - 40) as u16).to_be_bytes());
        } else {
            packet[2..4].copy_from_slice(&(total as u16).to_be_bytes());
            ipv4_header_checksum(packet, 20);
        }
    }
}

/// Why a super-packet from the TUN device could not be split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    #[error("truncated virtio header")]
    NoHeader,
    #[error("unsupported GSO type {0}")]
    GsoType(u8),
    #[error("malformed packet for its GSO type")]
    Malformed,
}

/// How to cut one TUN read into segments; built by [`plan_split`], applied with
/// [`SplitPlan::segment`] for `0..count` in order.
#[derive(Debug, Clone)]
pub struct SplitPlan {
    /// The whole packet after the virtio header, within the read buffer.
    packet: Range<usize>,
    kind: SplitKind,
}

#[derive(Debug, Clone)]
enum SplitKind {
    /// Pass the packet on as it is (after completing a partial checksum, if asked to).
    Whole,
    Segmented {
        layout: Layout,
        mss: usize,
        count: usize,
        template: [u8; MAX_HEADERS],
        first_seq: u32,
        first_id: u16,
        tcp_flags: u8,
    },
}

/// Reads the virtio header at the start of `read` (a whole TUN read) and prepares the packet:
/// a partial checksum is completed now; a GSO packet gets a plan for its segments.
pub fn plan_split(read: &mut [u8]) -> Result<SplitPlan, SplitError> {
    let hdr = VnetHdr::decode(read).ok_or(SplitError::NoHeader)?;
    let packet = VNET_HDR_LEN..read.len();
    let body = &mut read[VNET_HDR_LEN..];
    let gso = hdr.gso_type & !GSO_ECN;
    if gso == GSO_NONE {
        if hdr.flags & F_NEEDS_CSUM != 0 {
            let start = usize::from(hdr.csum_start);
            let at = start + usize::from(hdr.csum_offset);
            if at + 2 > body.len() {
                return Err(SplitError::Malformed);
            }
            // The field holds the pseudo-header sum; the sum over the rest completes it.
            let c = !fold(sum16(&body[start..], 0));
            body[at..at + 2].copy_from_slice(&c.to_be_bytes());
        }
        return Ok(SplitPlan {
            packet,
            kind: SplitKind::Whole,
        });
    }
    let layout = Layout::parse(body).ok_or(SplitError::Malformed)?;
    let expected = match gso {
        GSO_TCPV4 if !layout.v6 && layout.proto == PROTO_TCP => true,
        GSO_TCPV6 if layout.v6 && layout.proto == PROTO_TCP => true,
        GSO_UDP_L4 if layout.proto == PROTO_UDP => true,
        GSO_TCPV4 | GSO_TCPV6 | GSO_UDP_L4 => false,
        other => return Err(SplitError::GsoType(other)),
    };
    let mss = usize::from(hdr.gso_size);
    if !expected || mss == 0 {
        return Err(SplitError::Malformed);
    }
    let headers = layout.headers();
    let payload = body.len() - headers;
    let mut template = [0u8; MAX_HEADERS];
    template[..headers].copy_from_slice(&body[..headers]);
    let (first_seq, tcp_flags) = if layout.proto == PROTO_TCP {
        let t = &body[layout.ip_len..];
        (u32::from_be_bytes([t[4], t[5], t[6], t[7]]), t[13])
    } else {
        (0, 0)
    };
    Ok(SplitPlan {
        packet,
        kind: SplitKind::Segmented {
            layout,
            mss,
            count: payload.div_ceil(mss).max(1),
            template,
            first_seq,
            first_id: if layout.v6 {
                0
            } else {
                u16::from_be_bytes([body[4], body[5]])
            },
            tcp_flags,
        },
    })
}

impl SplitPlan {
    pub fn count(&self) -> usize {
        match &self.kind {
            SplitKind::Whole => 1,
            SplitKind::Segmented { count, .. } => *count,
        }
    }

    /// The bytes of all segments together (each with its own headers).
    pub fn plaintext_bytes(&self) -> usize {
        match &self.kind {
            SplitKind::Whole => self.packet.len(),
            SplitKind::Segmented { layout, count, .. } => {
                self.packet.len() + layout.headers() * (count - 1)
            }
        }
    }

    /// Segment `i`'s header length, its payload's range in the read and the headers to put
    /// before it; `None` for a read that is not split.
    fn payload_of(&self, i: usize) -> Option<(usize, Range<usize>, &[u8])> {
        let SplitKind::Segmented {
            layout,
            mss,
            template,
            ..
        } = &self.kind
        else {
            return None;
        };
        let headers = layout.headers();
        let start = self.packet.start + headers + i * mss;
        let end = (start + mss).min(self.packet.end);
        Some((headers, start..end, &template[..headers]))
    }

    /// Makes segment `i` a complete IP packet in place and returns its range in `read`. Call
    /// for `i = 0, 1, ...` in order: segment `i`'s headers are written over the last bytes of
    /// segment `i - 1`'s payload, which the caller has finished with by then.
    pub fn segment(&self, read: &mut [u8], i: usize) -> Range<usize> {
        let Some((headers, payload, template)) = self.payload_of(i) else {
            return self.packet.clone();
        };
        let start = payload.start - headers;
        let seg = &mut read[start..payload.end];
        if i > 0 {
            seg[..headers].copy_from_slice(template);
        }
        self.finish_segment(seg, i);
        start..payload.end
    }

    /// Writes segment `i` as a complete IP packet at the start of `dst` and returns its length;
    /// `read` is left as it is, so segments may be made in any order, by any thread (each into
    /// its own send slot, where it is sealed in place). `dst` needs room for the segment
    /// (at most the packet's headers plus its MSS, or the whole packet when it is not split).
    pub fn segment_into(&self, read: &[u8], i: usize, dst: &mut [u8]) -> usize {
        let Some((headers, payload, template)) = self.payload_of(i) else {
            let packet = &read[self.packet.clone()];
            dst[..packet.len()].copy_from_slice(packet);
            return packet.len();
        };
        let total = headers + payload.len();
        let seg = &mut dst[..total];
        seg[..headers].copy_from_slice(template);
        seg[headers..].copy_from_slice(&read[payload]);
        self.finish_segment(seg, i);
        total
    }

    /// Sets segment `i`'s IP ID, lengths, sequence number, flags and checksum in `seg` (its
    /// headers, from the template, then its payload).
    fn finish_segment(&self, seg: &mut [u8], i: usize) {
        let SplitKind::Segmented {
            layout,
            mss,
            count,
            first_seq,
            first_id,
            tcp_flags,
            ..
        } = &self.kind
        else {
            return;
        };
        let total = seg.len();
        if !layout.v6 {
            let id = first_id.wrapping_add(i as u16);
            seg[4..6].copy_from_slice(&id.to_be_bytes());
        }
        layout.set_ip_length(seg, total);
        let l4 = layout.ip_len;
        if layout.proto == PROTO_TCP {
            let seq = first_seq.wrapping_add((i * mss) as u32);
            seg[l4 + 4..l4 + 8].copy_from_slice(&seq.to_be_bytes());
            let mut flags = *tcp_flags;
            if i > 0 {
                flags &= !TCP_CWR;
            }
            if i + 1 < *count {
                flags &= !(TCP_FIN | TCP_PSH);
            }
            seg[l4 + 13] = flags;
        } else {
            seg[l4 + 4..l4 + 6].copy_from_slice(&((total - l4) as u16).to_be_bytes());
        }
        let at = layout.checksum_offset();
        seg[at..at + 2].fill(0);
        let sum = sum16(
            &seg[l4..],
            pseudo_sum(seg, layout.v6, layout.proto, total - l4),
        );
        let mut c = !fold(sum);
        if layout.proto == PROTO_UDP && c == 0 {
            c = 0xffff; // zero means "no checksum" for UDP
        }
        seg[at..at + 2].copy_from_slice(&c.to_be_bytes());
    }
}

/// One super-packet being assembled for a TUN write: virtio header, then an IP packet.
struct Slot {
    buf: Box<[u8]>,
    /// Bytes used, virtio header included.
    len: usize,
    state: SlotState,
}

#[derive(Debug, Clone, Copy)]
enum SlotState {
    Free,
    /// A packet written alone (not TCP/UDP with a payload, or not eligible to merge); its
    /// layout, when it has one, keeps later packets of its connection from overtaking it.
    Single(Option<Layout>),
    Flow(Flow),
}

impl SlotState {
    /// The layout of the slot's packet, when it has a parsable one.
    fn layout(&self) -> Option<Layout> {
        match self {
            SlotState::Flow(f) => Some(f.layout),
            SlotState::Single(layout) => *layout,
            SlotState::Free => None,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Flow {
    layout: Layout,
    /// Payload bytes of every segment but possibly the last.
    gso_size: usize,
    segments: u16,
    /// TCP: the sequence number the next segment must have.
    next_seq: u32,
    /// No more segments may follow (a short segment or PSH was appended).
    closed: bool,
}

/// Collects decrypted packets into as few TUN writes as possible. For each packet: check
/// [`Coalescer::needs_drain`], decrypt into [`Coalescer::landing`], then call
/// [`Coalescer::commit`] or [`Coalescer::abandon`]; [`Coalescer::drain`] writes everything out
/// (when full and at the end of each receive batch). A connection's packets keep their order.
pub struct Coalescer {
    slots: Vec<Slot>,
    used: usize,
    /// Coalesce UDP too (the TUN device accepts USO, Linux 6.2+).
    udp: bool,
    /// The slot the next packet is expected to extend: the newest slot of its connection.
    hot: Option<usize>,
    landing: Landing,
    saved: [u8; MAX_HEADERS],
}

#[derive(Debug, Clone, Copy)]
enum Landing {
    None,
    /// Decrypting at `start` in slot `slot`, over `saved_len` bytes of payload saved first.
    Overlap {
        slot: usize,
        start: usize,
        saved_len: usize,
    },
    Fresh {
        slot: usize,
    },
}

/// Room a slot keeps beyond the largest IP packet: the cipher writes its 16-byte tag after the
/// plaintext, and a landing may begin inside the previous payload.
const SLOT_BYTES: usize = VNET_HDR_LEN + MAX_IP_PACKET + MAX_HEADERS + 64;

impl Coalescer {
    /// At most `slots` super-packets per drain. Buffers are allocated now but only touched as
    /// traffic needs them.
    pub fn new(slots: usize, udp: bool) -> Coalescer {
        Coalescer {
            slots: (0..slots.max(2))
                .map(|_| Slot {
                    buf: vec![0u8; SLOT_BYTES].into_boxed_slice(),
                    len: 0,
                    state: SlotState::Free,
                })
                .collect(),
            used: 0,
            udp,
            hot: None,
            landing: Landing::None,
            saved: [0; MAX_HEADERS],
        }
    }

    /// True when every slot is taken: drain before the next landing.
    pub fn needs_drain(&self) -> bool {
        self.used == self.slots.len()
    }

    /// Where to decrypt a datagram of `datagram_len` bytes: right behind the payload of the
    /// flow the previous packet extended (its headers land over that payload's last bytes,
    /// saved first), else at the start of a free slot.
    pub fn landing(&mut self, datagram_len: usize) -> &mut [u8] {
        if let Some(h) = self.hot {
            let slot = &self.slots[h];
            if let SlotState::Flow(f) = slot.state {
                let headers = f.layout.headers();
                let start = slot.len - headers;
                if !f.closed && start + datagram_len <= SLOT_BYTES {
                    self.saved[..headers].copy_from_slice(&slot.buf[start..slot.len]);
                    self.landing = Landing::Overlap {
                        slot: h,
                        start,
                        saved_len: headers,
                    };
                    return &mut self.slots[h].buf[start..];
                }
            }
        }
        let slot = self.used;
        self.landing = Landing::Fresh { slot };
        &mut self.slots[slot].buf[VNET_HDR_LEN..]
    }

    /// The landing area received no packet for the TUN device (a handshake, an error): put back
    /// what it covered.
    pub fn abandon(&mut self) {
        if let Landing::Overlap {
            slot,
            start,
            saved_len,
        } = std::mem::replace(&mut self.landing, Landing::None)
        {
            self.slots[slot].buf[start..start + saved_len]
                .copy_from_slice(&self.saved[..saved_len]);
        }
    }

    /// The landing area now starts with a decrypted IP packet of `len` bytes: merge it into its
    /// flow or give it a slot of its own.
    pub fn commit(&mut self, len: usize) {
        match std::mem::replace(&mut self.landing, Landing::None) {
            Landing::None => {}
            Landing::Fresh { slot } => self.place_fresh(slot, len),
            Landing::Overlap {
                slot,
                start,
                saved_len,
            } => {
                let packet = &self.slots[slot].buf[start..start + len];
                if let Some(update) = self.extends(slot, packet) {
                    let psh = has_psh(packet, &update.layout);
                    // The payload is already in place; the headers give way to the saved bytes.
                    self.slots[slot].buf[start..start + saved_len]
                        .copy_from_slice(&self.saved[..saved_len]);
                    self.finish_append(slot, len - saved_len, update, psh);
                } else {
                    // Not the flow we guessed: move the packet to a free slot, then put back
                    // the bytes it was decrypted over.
                    let fresh = self.used;
                    let (src, dst) = two_slots(&mut self.slots, slot, fresh);
                    dst.buf[VNET_HDR_LEN..VNET_HDR_LEN + len]
                        .copy_from_slice(&src.buf[start..start + len]);
                    src.buf[start..start + saved_len].copy_from_slice(&self.saved[..saved_len]);
                    self.place_fresh(fresh, len);
                }
            }
        }
    }

    /// A packet decrypted at the start of free slot `slot`: append its payload to the flow it
    /// continues, or take the slot.
    fn place_fresh(&mut self, slot: usize, len: usize) {
        let packet = &self.slots[slot].buf[VNET_HDR_LEN..VNET_HDR_LEN + len];
        let layout = Layout::parse(packet);
        let mergeable = layout.filter(|l| self.mergeable(packet, l));
        // Only the newest slot of the same connection may be extended: anything older would
        // put this packet ahead of one that came before it.
        let newest = layout.and_then(|l| {
            (0..self.used).rev().find(|&i| {
                let head = &self.slots[i].buf[VNET_HDR_LEN..];
                (self.slots[i].state.layout())
                    .is_some_and(|o| same_connection(head, packet, &o, &l))
            })
        });
        if let (Some(layout), Some(other)) = (mergeable, newest) {
            if let Some(update) = self.extends(other, packet) {
                let headers = layout.headers();
                let psh = has_psh(packet, &layout);
                let (dst, src) = two_slots(&mut self.slots, other, slot);
                let at = dst.len;
                dst.buf[at..at + len - headers]
                    .copy_from_slice(&src.buf[VNET_HDR_LEN + headers..VNET_HDR_LEN + len]);
                self.finish_append(other, len - headers, update, psh);
                return;
            }
        }
        let s = &mut self.slots[slot];
        s.len = VNET_HDR_LEN + len;
        self.used += 1;
        let Some(layout) = mergeable else {
            s.state = SlotState::Single(layout);
            self.hot = None;
            return;
        };
        let packet = &s.buf[VNET_HDR_LEN..s.len];
        let payload = len - layout.headers();
        let tcp = layout.proto == PROTO_TCP;
        s.state = SlotState::Flow(Flow {
            layout,
            gso_size: payload,
            segments: 1,
            next_seq: if tcp {
                tcp_seq(packet, &layout).wrapping_add(payload as u32)
            } else {
                0
            },
            closed: has_psh(packet, &layout),
        });
        self.hot = Some(slot);
    }

    /// TCP with only ACK (or PSH|ACK) and a payload, or UDP with a payload when allowed.
    fn mergeable(&self, packet: &[u8], layout: &Layout) -> bool {
        if packet.len() <= layout.headers() {
            return false;
        }
        match layout.proto {
            PROTO_TCP => {
                let flags = packet[layout.ip_len + 13];
                flags == TCP_ACK || flags == TCP_ACK | TCP_PSH
            }
            _ => self.udp,
        }
    }

    /// If `packet` may be appended to the flow in `slot`, the flow's state after appending.
    fn extends(&self, slot: usize, packet: &[u8]) -> Option<Flow> {
        let s = &self.slots[slot];
        let SlotState::Flow(f) = s.state else {
            return None;
        };
        let layout = Layout::parse(packet)?;
        if f.closed || !self.mergeable(packet, &layout) {
            return None;
        }
        if !same_headers(&s.buf[VNET_HDR_LEN..], packet, &f.layout, &layout) {
            return None;
        }
        let payload = packet.len() - layout.headers();
        let total = s.len - VNET_HDR_LEN + payload;
        if payload > f.gso_size || total > MAX_IP_PACKET || f.segments >= MAX_SEGMENTS {
            return None;
        }
        let mut next = f;
        if layout.proto == PROTO_TCP {
            if tcp_seq(packet, &layout) != f.next_seq {
                return None;
            }
            next.next_seq = f.next_seq.wrapping_add(payload as u32);
        }
        next.segments += 1;
        next.closed = payload < f.gso_size || has_psh(packet, &layout);
        Some(next)
    }

    fn finish_append(&mut self, slot: usize, payload: usize, update: Flow, psh: bool) {
        let s = &mut self.slots[slot];
        s.len += payload;
        s.state = SlotState::Flow(update);
        if psh {
            // The super-packet carries the PSH of its last segment.
            s.buf[VNET_HDR_LEN + update.layout.ip_len + 13] |= TCP_PSH;
        }
        self.hot = Some(slot);
    }

    /// Writes every assembled super-packet through `write` (virtio header included), in the
    /// order they began, and frees all slots.
    pub fn drain(&mut self, mut write: impl FnMut(&[u8])) {
        for s in &mut self.slots[..self.used] {
            let hdr = match s.state {
                SlotState::Flow(f) if f.segments > 1 => {
                    let packet = &mut s.buf[VNET_HDR_LEN..s.len];
                    let total = packet.len();
                    let l = f.layout;
                    l.set_ip_length(packet, total);
                    if l.proto == PROTO_UDP {
                        let ulen = (total - l.ip_len) as u16;
                        packet[l.ip_len + 4..l.ip_len + 6].copy_from_slice(&ulen.to_be_bytes());
                    }
                    // CHECKSUM_PARTIAL: the field holds the pseudo-header sum and the kernel
                    // takes the segments as verified, which they are: the AEAD authenticated
                    // them (kernel WireGuard marks decrypted packets CHECKSUM_UNNECESSARY).
                    let at = l.checksum_offset();
                    let pseudo = fold(pseudo_sum(packet, l.v6, l.proto, total - l.ip_len));
                    packet[at..at + 2].copy_from_slice(&pseudo.to_be_bytes());
                    VnetHdr {
                        flags: F_NEEDS_CSUM,
                        gso_type: match (l.proto, l.v6) {
                            (PROTO_UDP, _) => GSO_UDP_L4,
                            (_, false) => GSO_TCPV4,
                            (_, true) => GSO_TCPV6,
                        },
                        hdr_len: l.headers() as u16,
                        gso_size: f.gso_size as u16,
                        csum_start: l.ip_len as u16,
                        csum_offset: (l.checksum_offset() - l.ip_len) as u16,
                    }
                }
                _ => VnetHdr::default(),
            };
            hdr.encode(&mut s.buf[..VNET_HDR_LEN]);
            write(&s.buf[..s.len]);
            s.len = 0;
            s.state = SlotState::Free;
        }
        self.used = 0;
        self.hot = None;
        self.landing = Landing::None;
    }
}

fn tcp_seq(packet: &[u8], layout: &Layout) -> u32 {
    let t = &packet[layout.ip_len..];
    u32::from_be_bytes([t[4], t[5], t[6], t[7]])
}

fn has_psh(packet: &[u8], layout: &Layout) -> bool {
    layout.proto == PROTO_TCP && packet[layout.ip_len + 13] & TCP_PSH != 0
}

/// Same IP version, transport, addresses and ports.
fn same_connection(head: &[u8], packet: &[u8], a: &Layout, b: &Layout) -> bool {
    if a.v6 != b.v6 || a.proto != b.proto {
        return false;
    }
    let addrs = if a.v6 { 8..40 } else { 12..20 };
    head[addrs.clone()] == packet[addrs]
        && head[a.ip_len..a.ip_len + 4] == packet[b.ip_len..b.ip_len + 4]
}

/// Headers equal in everything but lengths, IPv4 identification and checksums, and TCP
/// sequence, flags and window: what may differ between segments of one super-packet.
fn same_headers(head: &[u8], packet: &[u8], a: &Layout, b: &Layout) -> bool {
    if a != b || !same_connection(head, packet, a, b) {
        return false;
    }
    let ip_same = if a.v6 {
        // Version, class, flow label; next header, hop limit (addresses compared above).
        head[..4] == packet[..4] && head[6..8] == packet[6..8]
    } else {
        // Version, IHL, TOS; flags, fragment offset, TTL, protocol.
        head[0..2] == packet[0..2] && head[6..10] == packet[6..10]
    };
    if !ip_same || a.proto == PROTO_UDP {
        return ip_same;
    }
    let (h, p) = (&head[a.ip_len..], &packet[a.ip_len..]);
    // Acknowledgement, data offset; options.
    h[8..13] == p[8..13] && h[20..a.l4_len] == p[20..a.l4_len]
}

/// Two distinct slots, mutably.
fn two_slots(slots: &mut [Slot], a: usize, b: usize) -> (&mut Slot, &mut Slot) {
    assert_ne!(a, b, "two_slots needs distinct slots");
    if a < b {
        let (x, y) = slots.split_at_mut(b);
        (&mut x[a], &mut y[0])
    } else {
        let (x, y) = slots.split_at_mut(a);
        (&mut y[0], &mut x[b])
    }
}

#[cfg(test)]
mod tests;
