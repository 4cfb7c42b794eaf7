// Intel AMX (Advanced Matrix Extensions) for the C++ CPU kernels (cpu_amx_linear.cpp, cpu_paged_bf16.h): whether
// this process may use the tiles, and the tile configuration record LDTILECFG reads. MINIBATCH_AMX is defined where
// the build targets a CPU with AMX-BF16 (-march=native on one) on Linux; elsewhere amx_permitted() is false.
//
// Intel, "Intel Architecture Instruction Set Extensions Programming Reference", chapter 3 (AMX: tiles, palette 1,
// LDTILECFG, TILELOADD, TDPBF16PS). Linux gives a process the tile state only when asked (arch_prctl
// ARCH_REQ_XCOMP_PERM), done once per loaded extension.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define MINIBATCH_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace minibatch {

// Whether this process may run AMX: compiled in, and the kernel granted the tile state (asked once).
inline bool amx_permitted() {
#if defined(MINIBATCH_AMX)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
#else
  return false;
#endif
}

// LDTILECFG's 64-byte record (palette 1): each tile's rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

}  // namespace minibatch
