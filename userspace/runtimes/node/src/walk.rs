//! JavaScript frames on a copied native stack. V8 keeps frame pointers in the code it
//! generates and in its builtins, and a JavaScript frame keeps its context and its
//! function in the two words below its frame pointer (a typed frame, a stub's or an
//! exit's, keeps a Smi marker where the context is). The walk follows the frame
//! pointer chain inside the copy from the probe's `bp`; a frame is JavaScript when the
//! code it runs is V8's (generated code, or the embedded builtins), its marker slot
//! holds no Smi and its function slot a `JSFunction`. A frame in the builtins with a
//! bytecode array and offset in its slots is interpreted (the interpreter is a
//! builtin); one in generated code is compiled, whatever its slots hold (a loop
//! entered by on-stack replacement keeps its interpreted frame's slots, stale).
//!
//! Only the copy is read for the chain (it is what the thread's stack was at the
//! probe); the functions it names are read from the process's memory afterwards.

use allocbpf_runtime::toolkit::{RemoteMemory, StackCopy};

use crate::{
    heap::{is_object, smi, Heap},
    names::{CodeOffset, Names},
};

/// Whose code an address is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Code V8 generated (in no file).
    Generated,
    /// V8's embedded builtins (the interpreter among them).
    Builtins,
    /// Anything else (native code).
    Native,
}

/// Frames walked at most.
const MAX_FRAMES: usize = 256;

/// A JavaScript frame found on the stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JsFrame {
    /// Its `JSFunction` (tagged).
    pub function: u64,
    /// Where it is in its code.
    pub at: CodeOffset,
}

/// The frames in V8's code of a stack copied at a probe from its `sp` (the copy's
/// base), where `[sp]` is the return address and `bp` the caller's frame pointer,
/// innermost first: each one's address and its JavaScript frame, `None` for a frame
/// that is none (a stub's, an exit's), so that the caller can keep its place among the
/// native frames. `origin` tells whose code an address is in; `names` caches the
/// instance types read.
pub fn walk<M: RemoteMemory + ?Sized>(
    heap: &Heap<'_, M>,
    names: &mut Names,
    copy: &StackCopy<'_>,
    bp: u64,
    origin: &dyn Fn(u64) -> Origin,
) -> Vec<(u64, Option<JsFrame>)> {
    let mut frames = Vec::new();
    let Some(mut pc) = copy.word(copy.base) else {
        return frames;
    };
    let mut fp = bp;
    for _ in 0..MAX_FRAMES {
        // The frame at `fp` runs the code `pc` is in.
        let (Some(saved_fp), Some(return_address)) = (copy.word(fp), copy.word(fp.wrapping_add(8)))
        else {
            break;
        };
        let code = origin(pc);
        if code != Origin::Native {
            frames.push((pc, js_frame(heap, names, copy, fp, pc, code)));
        }
        // Frames grow down: a caller's frame is above.
        if saved_fp <= fp {
            break;
        }
        fp = saved_fp;
        pc = return_address;
    }
    frames
}

/// The JavaScript frame at `fp`, if it is one.
fn js_frame<M: RemoteMemory + ?Sized>(
    heap: &Heap<'_, M>,
    names: &mut Names,
    copy: &StackCopy<'_>,
    fp: u64,
    pc: u64,
    code: Origin,
) -> Option<JsFrame> {
    let slots = heap.layout.slots;
    let at_slot = |offset: i64| copy.word(fp.wrapping_add_signed(offset));
    let marker = at_slot(slots.context_or_type)?;
    if smi(marker).is_some() {
        return None;
    }
    let function = at_slot(slots.function)?;
    if !is_object(function)
        || !heap
            .layout
            .types
            .is_function(names.instance_type(heap, function)?)
    {
        return None;
    }
    let interpreted = (
        at_slot(slots.bytecode_array),
        at_slot(slots.bytecode_offset),
    );
    let bytecode_array = heap.layout.types.bytecode_array;
    let at = match interpreted {
        (Some(array), Some(offset))
            if code == Origin::Builtins
                && smi(offset).is_some()
                && names.instance_type(heap, array) == Some(bytecode_array) =>
        {
            // The slot counts from the array's tagged address to its bytecodes.
            let bias = heap.layout.fields.bytecode_data as i64 - 1;
            CodeOffset::Bytecode {
                array,
                offset: smi(offset)? - bias,
            }
        }
        _ => CodeOffset::Machine(pc),
    };
    Some(JsFrame { function, at })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forged::{self, layout, Forge};
    use crate::v8dbg::Layout;
    use allocbpf_runtime::toolkit::FakeMemory;

    /// What [`walk`] finds on a stack of `words` copied from `sp` up, starting at the
    /// frame pointer `bp`, in `memory` laid out as `layout`; addresses at or above
    /// `v8_code` are V8's (`origin`), the others native code.
    fn walked(
        memory: &FakeMemory,
        layout: &Layout,
        words: &[u64],
        sp: u64,
        bp: u64,
        (v8_code, origin): (u64, Origin),
    ) -> Vec<(u64, Option<JsFrame>)> {
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let copy = StackCopy {
            base: sp,
            bytes: &bytes,
        };
        let heap = Heap { memory, layout };
        let origin = |pc: u64| match pc >= v8_code {
            true => origin,
            false => Origin::Native,
        };
        walk(&heap, &mut Names::default(), &copy, bp, &origin)
    }

    #[test]
    fn js_frames_are_found_between_native_ones_and_loops_end() {
        let layout = layout();
        let mut memory = forged::heap();
        let function_map = memory.v8_map(0x1000, 2066);
        memory.object(0x5000, function_map);
        let function = 0x5001;
        let sp = 0x7000_0000u64;
        // sp: return address into native code; a native frame at sp+16, then a JS
        // frame at sp+80 (context, function, argc, bytecode array, offset), then a
        // frame pointer that points down (a loop): the walk ends.
        let mut words = vec![0u64; 32];
        words[0] = 0x40_0000; // [sp]: back into native code
        words[2] = sp + 80; // native frame's saved fp
        words[3] = 0x90_0000; // returns into V8 code
        words[10] = sp + 16; // JS frame's saved fp: below it, a loop
        words[11] = 0x90_0100;
        words[9] = 0x3001; // context (tagged)
        words[8] = function; // function
        words[5] = 7u64 << 32; // a bytecode offset (generated code: compiled all the same)
        let generated = (0x90_0000, Origin::Generated);
        let frames = walked(&memory, &layout, &words, sp, sp + 16, generated);
        let js = JsFrame {
            function,
            at: CodeOffset::Machine(0x90_0000),
        };
        assert_eq!(frames, vec![(0x90_0000, Some(js))]);
    }

    #[test]
    fn an_interpreted_frame_is_at_its_bytecode_and_a_typed_frame_is_none() {
        let layout = layout();
        let mut memory = forged::heap();
        let function_map = memory.v8_map(0x1000, 2066);
        let bytecode_map = memory.v8_map(0x1100, 191);
        let function = memory.object(0x5000, function_map);
        let array = memory.object(0x5100, bytecode_map);
        let sp = 0x7000_0000u64;
        // The interpreter's frame at sp+48 (its slots below: context, function, an
        // argument count, the bytecode array and offset), then a stub's frame at sp+96
        // (a Smi marker where the context is), whose saved fp ends the chain.
        let mut words = vec![0u64; 16];
        words[0] = 0x50_0000; // [sp]: in the builtins
        words[1] = forged::smi(53 + 7); // bytecode 7, counted from the tagged array
        words[2] = array;
        words[4] = function;
        words[5] = 0x3001; // context (tagged)
        words[6] = sp + 96;
        words[7] = 0x50_0100; // the stub's code, in the builtins too
        words[11] = forged::smi(4); // a typed frame's marker
        let builtins = (0x50_0000, Origin::Builtins);
        let frames = walked(&memory, &layout, &words, sp, sp + 48, builtins);
        let js = JsFrame {
            function,
            at: CodeOffset::Bytecode { array, offset: 7 },
        };
        assert_eq!(frames, vec![(0x50_0000, Some(js)), (0x50_0100, None)]);
    }
}
