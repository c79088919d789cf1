// A view of one paged cache, the one place its address arithmetic is written: slot -> (block,
// offset) -> row. Torch-free and CUDA-free; the same text serves the torch glue (which builds
// it), the CPU kernels and the CUDA kernels (nvcc and simt), like FlashInfer's paged_kv_t.
//
// The cache is [num_blocks, num_kv_heads, block_size, head_size] in any strides with the
// head_size dim contiguous: HND itself, an NHD tensor permuted to this order, or the K or V half
// of a combined [num_blocks, 2, ...] tensor. A row is the head_size elements of one token of one
// head. Slot s (slot_mapping) is token s % block_size of block s / block_size. All offsets are
// int64; callers pass narrower ints where they hold them (the products are taken in int64).
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define PAGEDKV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PAGEDKV_HOST_DEVICE inline
#endif

namespace pagedkv {

// Strides of a cache's block, head and token dims, in elements of the view's type (bytes for a
// PagedKV<char>).
struct CacheStrides {
  int64_t block;
  int64_t head;
  int64_t token;
};

// Where a slot lives: token `offset` of block `block`.
struct PagedKVSlot {
  int64_t block;
  int64_t offset;
};

// T is the element type: void in the parameter structs (the dtype is chosen at run time), the
// cache's element type once dispatched (as<C>()), char for dtype-free copies.
template <typename T>
struct PagedKV {
  T* data;               // [num_blocks, num_kv_heads, block_size, head_size], strides
  CacheStrides strides;  // in T
  int32_t block_size;

  template <typename U>
  PAGEDKV_HOST_DEVICE PagedKV<U> as() const {
    return {static_cast<U*>(data), strides, block_size};
  }

  PAGEDKV_HOST_DEVICE PagedKVSlot locate(int64_t slot) const {
    return {slot / block_size, slot % block_size};
  }

  // Offset of the row of token t of block b, head 0, from data.
  PAGEDKV_HOST_DEVICE int64_t offset(int64_t b, int64_t t) const {
    return b * strides.block + t * strides.token;
  }

  // Offset of the row of token t of head h from the start of its block.
  PAGEDKV_HOST_DEVICE int64_t in_block(int64_t h, int64_t t) const {
    return h * strides.head + t * strides.token;
  }

  // The start of block b.
  PAGEDKV_HOST_DEVICE T* block(int64_t b) const { return data + b * strides.block; }

  // The row of token s.offset of block s.block, head 0; head h's is h * strides.head further.
  PAGEDKV_HOST_DEVICE T* row(const PagedKVSlot& s) const {
    return data + s.block * strides.block + s.offset * strides.token;
  }

  // The same cache seen from element `dim` of head h's rows: its rows are that head's,
  // from that element on (a kernel's fixed head and lane offset, added once).
  PAGEDKV_HOST_DEVICE PagedKV head(int64_t h, int64_t dim = 0) const {
    return {data + h * strides.head + dim, strides, block_size};
  }

  // Whether a block's rows lie back to back in (head, token) order, row_size units each (HND).
  PAGEDKV_HOST_DEVICE bool dense_block(int64_t row_size) const {
    return strides.token == row_size && strides.head == block_size * strides.token;
  }
};

// The type-erased view the parameter structs hold.
using PagedKVView = PagedKV<void>;

}  // namespace pagedkv
