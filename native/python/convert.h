// Argument conversion for the bindings: keys, buffers and Status -> Python exceptions.
// Every function here runs with the GIL held.
#pragma once

#include <Python.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/typing.h>

#include <vector>

#include "tpusync/block_key.h"
#include "tpusync/status.h"
#include "tpusync/store.h"

namespace tpusync::py {

namespace pb = pybind11;

// Keys from a numpy uint64 array of shape (n, 2) [hi, lo], or a sequence whose items are
// non-negative ints below 2**128 or 16-byte big-endian bytes.
std::vector<BlockKey> ParseKeys(const pb::handle& keys);
BlockKey ParseKey(const pb::handle& key);
pb::int_ KeyToInt(const BlockKey& key);
// A pull's report as Python sees it: (held: list[bool], landed: list[bool], digests: uint64
// array), from per-key held states (net::HeldState) and the digests of the landed blocks.
using PullResult = pb::typing::Tuple<pb::typing::List<bool>, pb::typing::List<bool>, pb::array_t<uint64_t>>;
PullResult LandedDigests(const std::vector<uint8_t>& held, const std::vector<uint64_t>& digests);

// Holds Py_buffer views for the duration of a call (released with the GIL held).
class Buffers {
 public:
  // Each item of `seq` must export a C-contiguous buffer; writable if `writable`.
  Buffers(const pb::handle& seq, bool writable);
  ~Buffers();
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  std::vector<ConstBuffer> as_const() const;
  std::vector<MutableBuffer> as_mutable() const;
  size_t size() const { return views_.size(); }

 private:
  std::vector<Py_buffer> views_;
};

// Raises the tpusync.errors exception class for st.code() with st's message. st must not be Ok.
[[noreturn]] void Raise(const Status& st);
inline void ThrowIfError(const Status& st) {
  if (!st.ok()) Raise(st);
}

}  // namespace tpusync::py
