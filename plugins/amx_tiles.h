// Intel AMX tile set-up shared by the compiled kernels: the target's float32 GEMMs on bf16 tiles
// (target/amx_gemm.h) and the drafter's int8 GEMM on int8 tiles (draft_block/dot_gemm.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#define DFLASH_AMX_TILES 1

namespace dflash_tiles {

// Linux grants a process the tile registers on request (once; false where the kernel refuses).
inline bool granted() {
  static const bool ok = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Both kernels' tile plan, every row 64 bytes: tiles 0-2 C (m rows of 16 32-bit sums), 3 the inputs (m rows),
// 4-6 the weights (16 rows of 16 columns' 32-bit words).
inline void configure(int64_t m) {
  TileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = static_cast<uint8_t>(t >= 4 ? 16 : m);
  }
  // GCC (12) does not treat `ldtilecfg` as reading its operand and dropped the stores above (the zeroed widths
  // then fault): make the configuration visible in memory first.
  asm volatile("" ::"r"(&config) : "memory");
  _tile_loadconfig(&config);
}

}  // namespace dflash_tiles
#endif
