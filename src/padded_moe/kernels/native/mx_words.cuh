// MXFP4 weights in the native kernels (sm_90): the streaming 16-byte load they read weights with,
// the bf16x2 multiply that applies a scale, the upcast of a prepared 4-plane word into the bf16
// pairs of mma.sync's register operand, and the MMA. Shared by the native kernels and the probe in
// scripts/mx_decode_cuda.
#pragma once
#include <stdint.h>

// Weights are read once: 16 bytes, no L1 allocation.
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// A 4-plane word -> four bf16x2 pairs (plane p: elements 2c + 8p and 2c + 8p + 1), times the folded
// scale pair `s2`. The code bits placed as a bf16 are the value times 2^-126; the folded scale
// 2^(s-1) restores it exactly (`padded_moe.mxfp4.FOUR_PLANE_BITS`).
__device__ __forceinline__ void upcast(uint32_t w, uint32_t s2, uint32_t (&p)[4]) {
  p[0] = mul_bf16x2(w & 0x81C081C0u, s2);
  p[1] = mul_bf16x2((w << 3) & 0x81C081C0u, s2);
  p[2] = mul_bf16x2((w << 6) & 0x81C081C0u, s2);
  p[3] = mul_bf16x2(((w << 1) & 0x80008000u) | ((w >> 5) & 0x01000100u) | ((w >> 4) & 0x00C000C0u), s2);
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
