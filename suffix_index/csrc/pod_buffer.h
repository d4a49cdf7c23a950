// PodBuffer<T>: a growable array of trivially copyable T in its own anonymous memory mapping.
//
// The index's big arrays (nodes, child slots, the token arena, exact-key tables) grow to tens of MB.
// In std::vector each growth copies into a new heap block and frees the old one into malloc's free
// lists, where it stays resident; here a buffer past kMapBytes lives in its own mapping: growth is
// mremap (no copy on Linux), untouched capacity is never resident, and memory goes back to the system
// when the buffer shrinks or dies. Smaller buffers use malloc, so thousands of small indexes (one per
// request) do not run into the kernel's limit on mappings per process.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

namespace reprise {

template <typename T>
class PodBuffer {
  static_assert(std::is_trivially_copyable<T>::value, "PodBuffer holds plain data only");

 public:
  PodBuffer() = default;
  PodBuffer(size_t n, const T& fill) { resize(n, fill); }
  PodBuffer(const PodBuffer&) = delete;
  PodBuffer& operator=(const PodBuffer&) = delete;
  PodBuffer(PodBuffer&& o) noexcept { swap(o); }
  PodBuffer& operator=(PodBuffer&& o) noexcept {
    swap(o);
    return *this;
  }
  ~PodBuffer() { release(); }

  void swap(PodBuffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(cap_, o.cap_);
    std::swap(mapped_, o.mapped_);
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t capacity() const { return cap_; }
  bool empty() const { return size_ == 0; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  T* begin() { return data_; }
  T* end() { return data_ + size_; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + size_; }
  T& back() { return data_[size_ - 1]; }

  void reserve(size_t n) {
    if (n <= cap_) return;
    const size_t want = n * sizeof(T);
    void* p;
    size_t bytes;
    if (!mapped_ && want < kMapBytes) {
      bytes = want;
      p = std::realloc(data_, bytes);
      if (p == nullptr) throw std::bad_alloc();
    } else {
      bytes = (want + kPage - 1) / kPage * kPage;
      if (!mapped_) {  // moving out of the heap
        p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::bad_alloc();
        if (size_) std::memcpy(p, data_, size_ * sizeof(T));
        std::free(data_);
        mapped_ = true;
      } else {
#ifdef MREMAP_MAYMOVE
        p = mremap(data_, mapped_bytes(), bytes, MREMAP_MAYMOVE);
#else
        p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p != MAP_FAILED) {
          std::memcpy(p, data_, size_ * sizeof(T));
          munmap(data_, mapped_bytes());
        }
#endif
        if (p == MAP_FAILED) throw std::bad_alloc();
      }
    }
    data_ = static_cast<T*>(p);
    cap_ = bytes / sizeof(T);
  }

  // Grows geometrically (x1.5) so appends are amortised O(1).
  void resize(size_t n, const T& fill = T()) {
    if (n > cap_) reserve(std::max(n, cap_ + cap_ / 2));
    for (size_t i = size_; i < n; ++i) data_[i] = fill;
    size_ = n;
  }
  void push_back(const T& v) {
    if (size_ == cap_) reserve(std::max<size_t>(64, cap_ + cap_ / 2));
    data_[size_++] = v;
  }
  // Drops elements past n; returns whole unused pages to the system.
  void shrink_to(size_t n) {
    if (n < size_) size_ = n;
    if (!mapped_) return;
    const size_t keep = (size_ * sizeof(T) + kPage - 1) / kPage * kPage;
    if (keep + kPage < mapped_bytes()) madvise(reinterpret_cast<char*>(data_) + keep, mapped_bytes() - keep, MADV_DONTNEED);
  }
  void clear() {
    size_ = 0;
    shrink_to(0);
  }

 private:
  static constexpr size_t kPage = 4096;
  static constexpr size_t kMapBytes = size_t(1) << 20;
  size_t mapped_bytes() const { return (cap_ * sizeof(T) + kPage - 1) / kPage * kPage; }
  void release() {
    if (mapped_)
      munmap(data_, mapped_bytes());
    else
      std::free(data_);
    data_ = nullptr;
    size_ = cap_ = 0;
    mapped_ = false;
  }

  T* data_ = nullptr;
  size_t size_ = 0;
  size_t cap_ = 0;
  bool mapped_ = false;  // in its own mapping (else malloc'd)
};

}  // namespace reprise
