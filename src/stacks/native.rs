//! A thread's native frames, where they can be had without stopping it:
//! a thread blocked in the kernel shows its system call, stack pointer and
//! program counter in `/proc/PID/task/TID/syscall`. From those two the
//! call chain is unwound with the DWARF call frame information of each
//! mapped file's `.eh_frame` (x86-64; elsewhere only the innermost frame),
//! reading the saved return addresses from the thread's stack, and every
//! counter is named from its file's symbol table. A running thread has no
//! such record (reading its registers would need ptrace, which would stop
//! it and hand its stops to the one reaper), so it is said to be running.
//!
//! The walk follows only what the two registers it starts with allow: the
//! frame address from the stack or frame pointer plus an offset, the return
//! address and the frame pointer saved at an offset from it. It stops at
//! anything else (an expression rule, a register it does not know, a
//! counter outside the executable mappings, a stack that does not grow
//! towards its base), at 64 frames, or at the read's deadline.

#[cfg(target_arch = "x86_64")]
use std::cell::OnceCell;
use std::collections::HashMap;

use super::NativeFrame;
use super::budget::Budget;
use super::elf::{Elf, Functions};
use super::maps::{Mapping, file_of};

/// Most files whose symbols one read keeps.
const MAX_FILES: usize = 16;

/// x86-64 system call names a blocked training process is commonly in.
fn syscall_name(nr: i64) -> Option<&'static str> {
    Some(match nr {
        0 => "read",
        1 => "write",
        7 => "poll",
        23 => "select",
        35 => "nanosleep",
        45 => "recvfrom",
        47 => "recvmsg",
        61 => "wait4",
        202 => "futex",
        230 => "clock_nanosleep",
        232 => "epoll_wait",
        247 => "waitid",
        270 => "pselect6",
        271 => "ppoll",
        281 => "epoll_pwait",
        299 => "recvmmsg",
        441 => "epoll_pwait2",
        _ => return None,
    })
}

/// What one read keeps of a mapped file.
#[derive(Debug)]
struct Object {
    elf: Elf,
    /// Its functions, sorted by address.
    symbols: Functions,
    /// Its unwind tables, read when a walk first needs them (None: it has
    /// none that can be used).
    #[cfg(target_arch = "x86_64")]
    cfi: OnceCell<Option<unwind::Cfi>>,
}

/// Symbol tables and unwind tables of the files read so far (bounded in
/// count, and in bytes by the read's budget).
#[derive(Debug)]
pub struct Symbols {
    files: HashMap<String, Option<Object>>,
    /// What the read may still keep, and until when.
    budget: Budget,
}

impl Symbols {
    /// None read yet; what they keep is counted against `budget`.
    pub fn new(budget: &Budget) -> Symbols {
        Symbols { files: HashMap::new(), budget: budget.clone() }
    }

    /// The file mapped at `m`, opened on first use (None: it cannot be
    /// read, or the bound on files is reached).
    fn object(&mut self, pid: i32, m: &Mapping) -> Option<&Object> {
        if !self.files.contains_key(&m.path) && self.files.len() >= MAX_FILES {
            return None;
        }
        let budget = &self.budget;
        let entry = self.files.entry(m.path.clone()).or_insert_with(|| {
            let elf = Elf::open(&file_of(pid, &m.path), budget).ok()?;
            Some(Object {
                symbols: elf.functions().ok()?,
                elf,
                #[cfg(target_arch = "x86_64")]
                cfi: OnceCell::new(),
            })
        });
        entry.as_ref()
    }

    /// `pc` as the function it is in and the file it is from.
    pub fn name(&mut self, pid: i32, maps: &[Mapping], pc: u64) -> NativeFrame {
        let Some(m) = maps.iter().find(|m| m.start <= pc && pc < m.end) else {
            return NativeFrame { pc: format!("{pc:#x}"), function: None, object: "?".into() };
        };
        let object = super::clean(m.path.rsplit('/').next().unwrap_or(&m.path));
        let function = self.object(pid, m).and_then(|o| {
            let addr = pc.wrapping_sub(o.elf.bias(m.start, m.offset)?);
            let i = o.symbols.all.partition_point(|s| s.addr <= addr).checked_sub(1)?;
            let s = o.symbols.all.get(i)?;
            // Past a sized symbol's end is a function the file does not
            // name (a static one, in a file without .symtab): no name
            // rather than its neighbour's.
            let off = addr - s.addr;
            if s.size != 0 && off >= u64::from(s.size) {
                return None;
            }
            let name = o.elf.name_of(&o.symbols, s).filter(|n| !n.is_empty())?;
            Some(super::clean(&format!("{name}+{off:#x}")))
        });
        NativeFrame { pc: format!("{pc:#x}"), function, object }
    }
}

/// What `/proc/PID/task/TID/syscall` says of a thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kernel {
    /// It runs (or is runnable): no record.
    Running,
    /// Blocked, in system call `nr` (-1: blocked, not in a system call).
    Blocked { nr: i64, sp: u64, pc: u64 },
}

/// Parse the file's text.
pub fn parse_syscall(text: &str) -> Option<Kernel> {
    let text = text.trim();
    if text == "running" {
        return Some(Kernel::Running);
    }
    let f: Vec<&str> = text.split_whitespace().collect();
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    let nr = f.first()?.parse::<i64>().ok()?;
    let (sp, pc) = match f.len() {
        9 => (hex(f[7])?, hex(f[8])?),
        3 => (hex(f[1])?, hex(f[2])?),
        _ => return None,
    };
    Some(Kernel::Blocked { nr, sp, pc })
}

/// The thread's native frames, innermost first, and what they mean in
/// words. The walk up the stack stops at the deadline of the budget of
/// `symbols`.
pub fn frames(pid: i32, tid: i32, maps: &[Mapping], symbols: &mut Symbols) -> (Vec<NativeFrame>, String) {
    let text = match std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall")) {
        Ok(t) => t,
        Err(e) => return (Vec::new(), format!("no native frames: {}", super::Error::from_io(pid, &e))),
    };
    match parse_syscall(&text) {
        Some(Kernel::Running) => {
            (Vec::new(), "running (native frames are read only from a thread blocked in the kernel)".into())
        }
        Some(Kernel::Blocked { nr, sp, pc }) => {
            let what = match (nr, syscall_name(nr)) {
                (-1, _) => "blocked, not in a system call".to_string(),
                (_, Some(name)) => format!("blocked in system call {name}"),
                (n, None) => format!("blocked in system call {n}"),
            };
            let mut out = vec![symbols.name(pid, maps, pc)];
            #[cfg(target_arch = "x86_64")]
            out.extend(unwind::callers(pid, maps, symbols, unwind::Regs { pc, sp, bp: None }));
            #[cfg(not(target_arch = "x86_64"))]
            let _ = sp;
            (out, what)
        }
        None => (Vec::new(), "no native frames: unreadable syscall record".into()),
    }
}

/// The walk up a stack by the DWARF call frame information of x86-64's
/// `.eh_frame`: a pure step over one table row ([`step`]) and the loop
/// that finds each row and reads the stack ([`callers`]).
#[cfg(target_arch = "x86_64")]
mod unwind {
    use gimli::{
        BaseAddresses, CfaRule, EhFrame, EhFrameHdr, FrameDescriptionEntry, LittleEndian, Register, RegisterRule,
        UnwindContext, UnwindSection, UnwindTableRow, X86_64,
    };

    use super::super::NativeFrame;
    use super::super::elf::Elf;
    use super::super::maps::{Mapping, Mem};
    use super::Symbols;

    /// Most native frames of one thread.
    const MAX_FRAMES: usize = 64;
    /// Largest `.eh_frame` or `.eh_frame_hdr` read (libtorch_cpu's `.eh_frame`
    /// is ~17 MiB).
    const MAX_CFI: u64 = 64 << 20;
    /// Largest `.eh_frame` searched entry by entry, for a file without the
    /// sorted index of `.eh_frame_hdr` (every linker writes one for a shared
    /// library; a file without it is rare and, past this, too slow to search).
    const MAX_SCAN: usize = 1 << 20;

    /// A file's `.eh_frame` (and its index, `.eh_frame_hdr`), with the
    /// addresses they are at in the file's own address space.
    #[derive(Debug)]
    pub struct Cfi {
        eh_frame: Vec<u8>,
        eh_frame_addr: u64,
        hdr: Option<(Vec<u8>, u64)>,
        text_addr: Option<u64>,
    }

    impl Cfi {
        /// The tables of `elf`; None when it has no `.eh_frame` or it
        /// cannot be read.
        pub fn read(elf: &Elf) -> Option<Cfi> {
            let eh = elf.section(".eh_frame")?;
            let text_addr = elf.section(".text").map(|t| t.addr);
            // Both tables counted before either is read. Without the index,
            // a large `.eh_frame` is not searched (see [`MAX_SCAN`]), so it
            // is not read either.
            match elf.section(".eh_frame_hdr").filter(|h| h.size <= MAX_CFI) {
                Some(h) => {
                    let mut both = elf.sections_bytes(&[eh, h], MAX_CFI).ok()?;
                    let (hdr, eh_frame) = (both.pop()?, both.pop()?);
                    Some(Cfi { eh_frame, eh_frame_addr: eh.addr, hdr: Some((hdr, h.addr)), text_addr })
                }
                None if eh.size > u64::try_from(MAX_SCAN).unwrap_or(u64::MAX) => None,
                None => {
                    let eh_frame = elf.section_bytes(eh, MAX_CFI).ok()?;
                    Some(Cfi { eh_frame, eh_frame_addr: eh.addr, hdr: None, text_addr })
                }
            }
        }

        /// The row of the unwind table at `addr` (the file's address).
        pub fn row(&self, ctx: &mut UnwindContext<usize>, addr: u64) -> Option<Row> {
            let eh = EhFrame::new(&self.eh_frame, LittleEndian);
            let mut bases = BaseAddresses::default().set_eh_frame(self.eh_frame_addr);
            if let Some(text) = self.text_addr {
                bases = bases.set_text(text);
            }
            let fde = match &self.hdr {
                Some((bytes, at)) => {
                    bases = bases.set_eh_frame_hdr(*at);
                    let hdr = EhFrameHdr::new(bytes, LittleEndian).parse(&bases, 8).ok()?;
                    match hdr.table() {
                        Some(table) => table.fde_for_address(&eh, &bases, addr, EhFrame::cie_from_offset).ok()?,
                        None => self.scan(&eh, &bases, addr)?,
                    }
                }
                None => self.scan(&eh, &bases, addr)?,
            };
            let ra = fde.cie().return_address_register();
            let row = fde.unwind_info_for_address(&eh, &bases, ctx, addr).ok()?;
            Some(Row::of(row, ra))
        }

        /// The entry for `addr` searched one by one, in a small section.
        fn scan<'a>(
            &self,
            eh: &EhFrame<Reader<'a>>,
            bases: &BaseAddresses,
            addr: u64,
        ) -> Option<FrameDescriptionEntry<Reader<'a>>> {
            if self.eh_frame.len() > MAX_SCAN {
                return None;
            }
            eh.fde_for_address(bases, addr, EhFrame::cie_from_offset).ok()
        }
    }

    /// The section reader: the whole section in memory.
    type Reader<'a> = gimli::EndianSlice<'a, LittleEndian>;

    /// A register the frame address is computed from.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Base {
        /// RSP.
        Sp,
        /// RBP.
        Bp,
    }

    /// Where the caller's value of a register is.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Rule {
        /// Unchanged by this frame.
        Same,
        /// Not recoverable (for the return address: the outermost frame).
        Undefined,
        /// Saved at the frame address plus this.
        At(i64),
        /// The frame address plus this.
        Val(i64),
        /// A rule this walk does not follow (an expression, another register).
        Unknown,
    }

    /// What this walk uses of one row of a function's unwind table.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Row {
        /// The frame address (CFA): a register plus an offset; None when
        /// it is computed otherwise.
        pub cfa: Option<(Base, i64)>,
        /// The return address.
        pub ra: Rule,
        /// The caller's RBP.
        pub bp: Rule,
    }

    impl Row {
        fn of(row: &UnwindTableRow<usize>, ra: Register) -> Row {
            let cfa = match row.cfa() {
                CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RSP => {
                    Some((Base::Sp, *offset))
                }
                CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RBP => {
                    Some((Base::Bp, *offset))
                }
                _ => None,
            };
            // A register without a rule keeps its value; the return
            // address always has one (the CIE's), so without it there is
            // no caller.
            let rule = |r: Register, default: Rule| match row.register(r) {
                None => default,
                Some(RegisterRule::Undefined) => Rule::Undefined,
                Some(RegisterRule::SameValue) => Rule::Same,
                Some(RegisterRule::Offset(n)) => Rule::At(n),
                Some(RegisterRule::ValOffset(n)) => Rule::Val(n),
                Some(_) => Rule::Unknown,
            };
            Row { cfa, ra: rule(ra, Rule::Undefined), bp: rule(X86_64::RBP, Rule::Same) }
        }
    }

    /// The registers a walk knows of one frame.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Regs {
        /// The program counter (a caller's: its return address).
        pub pc: u64,
        /// The stack pointer.
        pub sp: u64,
        /// The frame pointer, when known.
        pub bp: Option<u64>,
    }

    /// The caller's registers from the callee's and its row, reading the
    /// stack's words with `read`; None where the walk ends: a rule it does
    /// not follow, an unknown register, a failed read, a return address
    /// of 0, a caller's stack that is not above the callee's.
    pub fn step(row: &Row, regs: Regs, mut read: impl FnMut(u64) -> Option<u64>) -> Option<Regs> {
        let (base, offset) = row.cfa?;
        let base = match base {
            Base::Sp => regs.sp,
            Base::Bp => regs.bp?,
        };
        let cfa = base.checked_add_signed(offset)?;
        if cfa <= regs.sp {
            return None;
        }
        let pc = match row.ra {
            Rule::At(n) => read(cfa.checked_add_signed(n)?)?,
            Rule::Same | Rule::Undefined | Rule::Val(_) | Rule::Unknown => return None,
        };
        if pc == 0 {
            return None;
        }
        let bp = match row.bp {
            Rule::Same => regs.bp,
            Rule::At(n) => cfa.checked_add_signed(n).and_then(&mut read),
            Rule::Val(n) => cfa.checked_add_signed(n),
            Rule::Undefined | Rule::Unknown => None,
        };
        Some(Regs { pc, sp: cfa, bp })
    }

    /// Most bytes of a frame searched for its return address.
    const MAX_GUESS: u64 = 4096;

    /// RBP of a frame whose frame address is RBP-based while RBP is not
    /// known. The walk starts without it (the kernel's record has only the
    /// stack pointer and the counter), and a C library's system call
    /// wrapper leaves it in the register, so the first caller built with
    /// frame pointers (Rust's std, a distribution's Python) would end the
    /// walk. Its return address is then looked for on the stack: the first
    /// word above `sp` that returns into executable code just after a call
    /// instruction; the row says where the return address is from the frame
    /// address, and the frame address from RBP.
    fn guess_bp(row: &Row, sp: u64, mem: &Mem, maps: &[Mapping]) -> Option<u64> {
        let (Some((Base::Bp, offset)), Rule::At(ra_at)) = (row.cfa, row.ra) else { return None };
        // Up to the end of the page after sp's; else of sp's own page (the
        // stack may end there).
        let page_end = (sp | 0xfff).checked_add(1)?;
        let stack = [page_end.saturating_add(0x1000), page_end].into_iter().find_map(|end| {
            let len = end.min(sp.saturating_add(MAX_GUESS)).saturating_sub(sp);
            mem.bytes(sp, usize::try_from(len).ok()?).ok()
        })?;
        let slot = (sp..).step_by(8).zip(stack.chunks_exact(8)).find_map(|(addr, word)| {
            let word = u64::from_le_bytes(word.try_into().ok()?);
            let code = maps.iter().any(|m| m.exec && m.start < word && word <= m.end);
            let called = code && mem.bytes(word.checked_sub(7)?, 7).is_ok_and(|b| is_call_before(&b));
            called.then_some(addr)
        })?;
        slot.checked_add_signed(ra_at.checked_neg()?)?.checked_add_signed(offset.checked_neg()?)
    }

    /// Whether `code`, the 7 bytes before a return address, end in an x86-64
    /// call: `e8` and a 32-bit displacement, or `ff /2` with whatever its
    /// ModRM byte says follows it.
    pub fn is_call_before(code: &[u8]) -> bool {
        let n = code.len();
        if n >= 5 && code[n - 5] == 0xe8 {
            return true;
        }
        (0..n.saturating_sub(1)).any(|at| {
            let (op, modrm) = (code[at], code[at + 1]);
            let (md, reg, rm) = (modrm >> 6, (modrm >> 3) & 7, modrm & 7);
            let sib_base = code.get(at + 2).map(|sib| sib & 7);
            let sib = usize::from(md != 3 && rm == 4);
            let disp = match md {
                1 => 1,
                2 => 4,
                0 if rm == 5 || (rm == 4 && sib_base == Some(5)) => 4,
                _ => 0,
            };
            op == 0xff && reg == 2 && at + 2 + sib + disp == n
        })
    }

    /// The callers of the frame `first` (its caller first), named, until
    /// the walk ends, [`MAX_FRAMES`] in all, or the read's deadline.
    pub fn callers(pid: i32, maps: &[Mapping], symbols: &mut Symbols, first: Regs) -> Vec<NativeFrame> {
        let mem = Mem { pid };
        let mut ctx = UnwindContext::new();
        let mut out = Vec::new();
        let mut regs = first;
        // The innermost counter is where the thread is; a caller's is a
        // return address, just after its call, which may end a function:
        // its row is the call's, one byte before.
        let mut at = regs.pc;
        while out.len() + 1 < MAX_FRAMES && !symbols.budget.late() {
            let Some(m) = maps.iter().find(|m| m.exec && m.start <= at && at < m.end) else { break };
            let row = symbols.object(pid, m).and_then(|o| {
                let bias = o.elf.bias(m.start, m.offset)?;
                o.cfi.get_or_init(|| Cfi::read(&o.elf)).as_ref()?.row(&mut ctx, at.wrapping_sub(bias))
            });
            let Some(row) = row else { break };
            if matches!(row.cfa, Some((Base::Bp, _))) && regs.bp.is_none() {
                regs.bp = guess_bp(&row, regs.sp, &mem, maps);
            }
            let Some(next) = step(&row, regs, |addr| mem.u64(addr).ok()) else { break };
            out.push(symbols.name(pid, maps, next.pc));
            regs = next;
            at = next.pc.saturating_sub(1);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_kernels_syscall_record() {
        assert_eq!(parse_syscall("running\n"), Some(Kernel::Running));
        assert_eq!(
            parse_syscall("230 0x0 0x0 0x7ffd 0x7ffd 0x0 0x0 0x7ffc3b2c4a10 0x7f0b6c2e4b7a\n"),
            Some(Kernel::Blocked { nr: 230, sp: 0x7ffc_3b2c_4a10, pc: 0x7f0b_6c2e_4b7a })
        );
        assert_eq!(parse_syscall("-1 0x7ffc 0x7f0b\n"), Some(Kernel::Blocked { nr: -1, sp: 0x7ffc, pc: 0x7f0b }));
        assert_eq!(parse_syscall("12 0x1"), None);
        assert_eq!(parse_syscall(""), None);
    }

    /// The thread named `name` of this process, once it is blocked in
    /// system call `nr`.
    fn blocked_thread(name: &str, nr: i64) -> i32 {
        for _ in 0..500 {
            let tasks = std::fs::read_dir("/proc/self/task").expect("tasks");
            for task in tasks.flatten() {
                let path = task.path();
                let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
                let syscall = std::fs::read_to_string(path.join("syscall")).unwrap_or_default();
                if comm.trim() == name
                    && matches!(parse_syscall(&syscall), Some(Kernel::Blocked { nr: n, .. }) if n == nr)
                {
                    return task.file_name().to_string_lossy().parse().expect("tid");
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("no thread {name} blocked in system call {nr}");
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn unwinds_a_thread_blocked_in_read() {
        use std::io::{Read, Write};
        let (mut reader, mut writer) = std::io::pipe().expect("pipe");
        let blocked = std::thread::Builder::new()
            .name("unwind-probe".into())
            .spawn(move || {
                let mut byte = [0u8];
                reader.read(&mut byte).expect("read")
            })
            .expect("spawn");
        let tid = blocked_thread("unwind-probe", 0);
        let pid = i32::try_from(std::process::id()).expect("pid");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let budget = Budget::new(super::super::budget::WORKER_BYTES, Some(deadline));
        let maps = super::super::maps::read(pid, &budget).expect("maps");
        let (frames, what) = frames(pid, tid, &maps, &mut Symbols::new(&budget));
        writer.write_all(b"x").expect("write");
        assert_eq!(blocked.join().expect("join"), 1);

        let names: Vec<&str> = frames.iter().map(|f| f.function.as_deref().unwrap_or("?")).collect();
        assert_eq!(what, "blocked in system call read");
        assert!(frames.len() > 2, "{names:?}");
        assert!(names[0].contains("read"), "{names:?}");
        // Through the test's own closure to the thread's start, in std.
        assert!(names.iter().any(|n| n.contains("unwinds_a_thread_blocked_in_read")), "{names:?}");
        assert!(names.iter().any(|n| n.contains("thread_start") || n.contains("start_thread")), "{names:?}");
        let exe = std::env::current_exe().expect("exe");
        let exe = exe.file_name().expect("name").to_string_lossy();
        assert!(frames.iter().all(|f| f.object == exe), "{frames:?}");
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn a_row_gives_the_callers_registers() {
        use unwind::{Base, Regs, Row, Rule, step};
        // A stack of words: 0x1000 holds 0x1111, 0x1008 holds 0x2222, ...
        let stack = |addr: u64| (0x1000..0x1100).contains(&addr).then(|| (addr - 0x1000) / 8 * 0x1111 + 0x1111);
        let regs = Regs { pc: 0x40_0000, sp: 0x1000, bp: None };
        let at_sp = |cfa: i64| Row { cfa: Some((Base::Sp, cfa)), ra: Rule::At(-8), bp: Rule::Same };
        let table: [(&str, Row, Regs, Option<Regs>); 9] = [
            ("leaf: cfa=rsp+8", at_sp(8), regs, Some(Regs { pc: 0x1111, sp: 0x1008, bp: None })),
            ("rbp kept", at_sp(16), Regs { bp: Some(7), ..regs }, Some(Regs { pc: 0x2222, sp: 0x1010, bp: Some(7) })),
            (
                "rbp saved at cfa-16",
                Row { bp: Rule::At(-16), ..at_sp(24) },
                regs,
                Some(Regs { pc: 0x3333, sp: 0x1018, bp: Some(0x2222) }),
            ),
            (
                "cfa=rbp+16",
                Row { cfa: Some((Base::Bp, 16)), ra: Rule::At(-8), bp: Rule::At(-16) },
                Regs { bp: Some(0x1010), ..regs },
                Some(Regs { pc: 0x4444, sp: 0x1020, bp: Some(0x3333) }),
            ),
            ("cfa=rbp+16, rbp unknown", Row { cfa: Some((Base::Bp, 16)), ..at_sp(0) }, regs, None),
            ("cfa by expression", Row { cfa: None, ..at_sp(0) }, regs, None),
            ("outermost: ra undefined", Row { ra: Rule::Undefined, ..at_sp(8) }, regs, None),
            ("stack does not grow", at_sp(0), regs, None),
            ("unreadable return address", at_sp(0x1000), regs, None),
        ];
        for (what, row, regs, want) in table {
            assert_eq!(step(&row, regs, stack), want, "{what}");
        }
        let zero = |_| Some(0);
        assert_eq!(step(&at_sp(8), regs, zero), None, "return address 0");
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn calls_are_known_by_the_bytes_before_the_return_address() {
        use unwind::is_call_before;
        let table: [(&str, [u8; 7], bool); 10] = [
            ("call rel32", [0x48, 0x89, 0xe8, 0x10, 0x20, 0x30, 0x40], true),
            ("call *%rax", [0, 0, 0, 0, 0, 0xff, 0xd0], true),
            ("call *%r11", [0, 0, 0, 0, 0x41, 0xff, 0xd3], true),
            ("call *disp32(%rip)", [0, 0xff, 0x15, 1, 2, 3, 4], true),
            ("call *0x8(%rax)", [0, 0, 0, 0, 0xff, 0x50, 0x08], true),
            ("call *0x8(%rsp)", [0, 0, 0, 0xff, 0x54, 0x24, 0x08], true),
            ("call *disp32(%rax,%rbx,8)", [0xff, 0x94, 0xd8, 1, 2, 3, 4], true),
            ("jmp *%rax", [0, 0, 0, 0, 0, 0xff, 0xe0], false),
            ("mov %rax,%rdi; ret", [0, 0, 0, 0x48, 0x89, 0xc7, 0xc3], false),
            ("call *%rax, then one more byte", [0, 0, 0, 0, 0xff, 0xd0, 0x90], false),
        ];
        for (what, code, want) in table {
            assert_eq!(is_call_before(&code), want, "{what}");
        }
    }
}
