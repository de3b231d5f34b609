// The AMX tile setup shared by the kernels that multiply bf16 on tiles: four 16 x 16 float
// accumulators (tiles 0-3), and tiles 4-7 for 16 x 32 bf16 operands, every tile 16 rows of
// 64 bytes.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define RADIXSERVE_AMX 1
#endif

namespace radixserve {

constexpr int64_t kAmxDepth = 32;  // bf16 products summed per tile step
constexpr int64_t kAmxRows = 16;   // rows of an operand or accumulator tile

constexpr int64_t round_up(int64_t size, int64_t multiple) {
  return (size + multiple - 1) / multiple * multiple;
}

#if defined(RADIXSERVE_AMX)
// Linux hands out the AMX register state only to a process that asks for it once.
inline bool amx_permitted() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  static const bool permitted =
      syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Once per thread before its tile instructions (and _tile_release() after them).
inline void configure_tiles() {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    config.rows[tile] = kAmxRows;
    config.colsb[tile] = 64;
  }
  _tile_loadconfig(&config);
}

inline void zero_accumulators() {  // tile numbers are immediates
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// One tile step: 16 rows x 32 bf16 of A (`a`, rows `a_stride` bytes apart) times four B
// tiles of 1 KiB (`b`, each `b_step` bytes after the last), into accumulators 0-3.
inline void multiply_four_tiles(const void* a, int64_t a_stride, const void* b, int64_t b_step) {
  const char* tiles = static_cast<const char*>(b);
  _tile_loadd(4, a, a_stride);
  _tile_loadd(5, tiles, 64);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(6, tiles + b_step, 64);
  _tile_dpbf16ps(1, 4, 6);
  _tile_loadd(7, tiles + 2 * b_step, 64);
  _tile_dpbf16ps(2, 4, 7);
  _tile_loadd(5, tiles + 3 * b_step, 64);
  _tile_dpbf16ps(3, 4, 5);
}

// The four accumulators side by side: 16 rows of 64 floats, `stride` floats apart.
inline void store_accumulators(float* sums, int64_t stride) {
  const int64_t bytes = stride * static_cast<int64_t>(sizeof(float));
  _tile_stored(0, sums, bytes);
  _tile_stored(1, sums + 16, bytes);
  _tile_stored(2, sums + 32, bytes);
  _tile_stored(3, sums + 48, bytes);
}
#endif

}  // namespace radixserve
