// A program that calls itself node and is not one, for allocbpf's Node.js tests (the
// workload protocol: prints its pid, waits for "go" on stdin, allocates, exits).
//
// Built three ways:
//   -DPLAIN   no V8 constant at all: a binary named node that is none;
//   -DFORGED  V8's debug constants (v8dbg_*), Node.js 20's values but one that no V8
//             build has (a frame slot 4096 bytes above the frame pointer);
//   default   Node.js 20's constants, all plausible, and a function named like V8's
//             allocation-observer step whose code is not V8's: the step is refused,
//             so its calls (with forged spaces) are never counted.
// Whatever it is, its mallocs are profiled natively (`forged_site`).
//
// Usage: node  (named so by the test)
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#ifndef PLAIN
#define C(name, value) int v8dbg_##name = value;
C(TaggedSize, 8)
C(SystemPointerSize, 8)
C(HeapObjectTag, 1)
C(HeapObjectTagMask, 3)
C(SmiTagMask, 1)
C(SmiShiftSize, 31)
C(type_JSFunction__JS_FUNCTION_TYPE, 2066)
C(type_SharedFunctionInfo__SHARED_FUNCTION_INFO_TYPE, 262)
C(type_Script__SCRIPT_TYPE, 167)
C(type_ScopeInfo__SCOPE_INFO_TYPE, 261)
C(type_BytecodeArray__BYTECODE_ARRAY_TYPE, 191)
C(type_ByteArray__BYTE_ARRAY_TYPE, 190)
C(type_FixedArray__FIXED_ARRAY_TYPE, 175)
C(type_Code__CODE_TYPE, 245)
C(type_WeakFixedArray__WEAK_FIXED_ARRAY_TYPE, 240)
C(type_InstructionStream__INSTRUCTION_STREAM_TYPE, 252)
C(FirstNonstringType, 128)
C(StringRepresentationMask, 7)
C(StringEncodingMask, 8)
C(OneByteStringTag, 8)
C(SeqStringTag, 0)
C(ConsStringTag, 1)
C(ExternalStringTag, 2)
C(SlicedStringTag, 3)
C(ThinStringTag, 5)
C(class_FixedArrayBase__length__SMI, 8)
C(class_JSFunction__shared__SharedFunctionInfo, 24)
C(class_HeapObject__map__Map, 0)
C(class_Map__instance_type__uint16_t, 12)
C(class_SharedFunctionInfo__name_or_scope_info__Object, 16)
C(class_SharedFunctionInfo__script_or_debug_info__HeapObject, 32)
C(class_Script__name__Object, 16)
C(class_Script__source__Object, 8)
C(class_Script__line_ends__Object, 56)
C(class_String__length__int32_t, 12)
C(class_SeqOneByteString__chars__char, 16)
C(class_SeqTwoByteString__chars__char, 16)
C(class_ConsString__first__String, 16)
C(class_ConsString__second__String, 24)
C(class_ThinString__actual__String, 16)
C(class_SlicedString__parent__String, 16)
C(class_SlicedString__offset__SMI, 24)
C(class_ExternalString__resource__Object, 16)
C(class_FixedArray__data__uintptr_t, 16)
C(class_BytecodeArray__data__uintptr_t, 54)
C(class_Code__source_position_table__ByteArray, 24)
C(class_Code__deoptimization_data__FixedArray, 16)
C(class_InstructionStream__instruction_start__uintptr_t, 16)
C(DeoptimizationDataLiteralArrayIndex, 2)
C(DeoptimizationDataInliningPositionsIndex, 7)
C(CodeKindFieldMask, 15)
C(CodeKindBaseline, 11)
C(scopeinfo_idx_ncontextlocals, 2)
C(scopeinfo_idx_first_vars, 3)
C(off_fp_context_or_frame_type, -8)
C(off_fp_bytecode_array, -32)
C(off_fp_bytecode_offset, -40)
#ifdef FORGED
C(off_fp_function, 4096)
#else
C(off_fp_function, -16)
#endif

int _ZN2v88internal7Version6major_E = 11;
int _ZN2v88internal7Version6minor_E = 3;
int _ZN2v88internal7Version6build_E = 244;

// Named like V8 11's allocation-observer step (`SpaceWithLinearArea::
// AdvanceAllocationObservers()`), called with a forged space: its code is not V8's.
__attribute__((noinline)) void _ZN2v88internal19SpaceWithLinearArea26AdvanceAllocationObserversEv(
    volatile long *space) {
    space[0] += 1 << 20;
}
#endif

static void *volatile sink;

__attribute__((noinline)) void forged_site(void) {
    sink = malloc(4096);
    free(sink);
}

int main(void) {
    printf("%d\n", getpid());
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 1;
    static long space[64];
    for (int i = 0; i < 200000; i++) {
        forged_site();
#ifndef PLAIN
        _ZN2v88internal19SpaceWithLinearArea26AdvanceAllocationObserversEv(space);
#endif
    }
    return 0;
}
