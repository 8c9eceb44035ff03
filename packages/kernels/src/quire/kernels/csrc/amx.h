// AMX set-up shared by Quire's CPU kernels that use tile registers (onednn_gemv.cpp, prefill_attention.cpp).
// QUIRE_AMX is defined where the build targets AVX-512 BF16 and AMX BF16; callers still check amx_permitted().
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QUIRE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace quire {

// Linux gives a process the AMX tile registers only once it asks (oneDNN asks the same for its own kernels).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t columns_bytes[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles 16 rows of 64 bytes: 16 x 16 float32 sums, 16 x 32 bfloat16 rows, or 16 pairs of 16 bfloat16.
inline const TileConfig& full_tile_config() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = 16;
      c.columns_bytes[t] = 64;
    }
    return c;
  }();
  return config;
}

}  // namespace quire
#endif
