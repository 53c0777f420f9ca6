//! Classic BPF as the kernel takes it (`struct sock_filter`, linux/filter.h and
//! linux/bpf_common.h): the instruction and the opcode parts the seccomp filter and the
//! reuse-port steering program are written with.

/// One classic-BPF instruction: the kernel's `struct sock_filter`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Instruction {
    pub code: u16,
    pub jt: u8,
    pub jf: u8,
    pub k: u32,
}

impl Instruction {
    pub const fn new(code: u16, jt: u8, jf: u8, k: u32) -> Instruction {
        Instruction { code, jt, jf, k }
    }
}

pub const BPF_LD: u16 = 0x00;
pub const BPF_ALU: u16 = 0x04;
pub const BPF_JMP: u16 = 0x05;
pub const BPF_RET: u16 = 0x06;
pub const BPF_W: u16 = 0x00;
pub const BPF_B: u16 = 0x10;
pub const BPF_ABS: u16 = 0x20;
pub const BPF_JA: u16 = 0x00;
pub const BPF_JEQ: u16 = 0x10;
pub const BPF_JGE: u16 = 0x30;
pub const BPF_JSET: u16 = 0x40;
pub const BPF_MOD: u16 = 0x90;
pub const BPF_K: u16 = 0x00;
pub const BPF_A: u16 = 0x10;
