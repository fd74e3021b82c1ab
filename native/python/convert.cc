#include "convert.h"

#include <pybind11/numpy.h>

#include <string>

namespace tpusync::py {

BlockKey ParseKey(const pb::handle& key) {
  if (PyLong_Check(key.ptr())) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(key.ptr(), &overflow);
    if (overflow == 0 && v >= 0) return {0, static_cast<uint64_t>(v)};  // the common case
    if (overflow < 0 || (overflow == 0 && v < 0)) Raise(InvalidArgument("block key must be non-negative"));
    uint64_t lo = PyLong_AsUnsignedLongLongMask(key.ptr());
    static PyObject* const k64 = PyLong_FromLong(64);
    pb::object hi_obj = pb::reinterpret_steal<pb::object>(PyNumber_Rshift(key.ptr(), k64));
    uint64_t hi = PyLong_AsUnsignedLongLong(hi_obj.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      Raise(InvalidArgument("block key must be below 2**128"));
    }
    return {hi, lo};
  }
  if (PyBytes_Check(key.ptr())) {
    if (PyBytes_GET_SIZE(key.ptr()) != 16) Raise(InvalidArgument("a bytes block key must be 16 bytes"));
    const auto* b = reinterpret_cast<const unsigned char*>(PyBytes_AS_STRING(key.ptr()));
    BlockKey k;
    for (int i = 0; i < 8; ++i) k.hi = (k.hi << 8) | b[i];
    for (int i = 8; i < 16; ++i) k.lo = (k.lo << 8) | b[i];
    return k;
  }
  throw pb::type_error("a block key is an int, 16 bytes, or a row of a (n, 2) uint64 array");
}

std::vector<BlockKey> ParseKeys(const pb::handle& keys) {
  std::vector<BlockKey> out;
  if (pb::isinstance<pb::array>(keys)) {
    auto arr = pb::array::ensure(keys);
    if (!arr.dtype().is(pb::dtype::of<uint64_t>()) || arr.ndim() != 2 || arr.shape(1) != 2) {
      throw pb::type_error("a key array must be uint64 with shape (n, 2): [hi, lo] per key");
    }
    auto a = pb::array_t<uint64_t, pb::array::c_style | pb::array::forcecast>::ensure(keys);
    auto r = a.unchecked<2>();
    out.resize(static_cast<size_t>(r.shape(0)));
    for (size_t i = 0; i < out.size(); ++i) out[i] = {r(i, 0), r(i, 1)};
    return out;
  }
  pb::sequence seq = pb::reinterpret_borrow<pb::sequence>(keys);
  out.reserve(seq.size());
  for (size_t i = 0; i < seq.size(); ++i) out.push_back(ParseKey(seq[i]));
  return out;
}

pb::int_ KeyToInt(const BlockKey& key) {
  pb::int_ hi(key.hi), lo(key.lo);
  return pb::reinterpret_steal<pb::int_>(
      PyNumber_Or(hi.attr("__lshift__")(64).ptr(), lo.ptr()));
}

Buffers::Buffers(const pb::handle& seq_obj, bool writable) {
  pb::sequence seq = pb::reinterpret_borrow<pb::sequence>(seq_obj);
  views_.reserve(seq.size());
  int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  for (size_t i = 0; i < seq.size(); ++i) {
    Py_buffer view;
    if (PyObject_GetBuffer(seq[i].ptr(), &view, flags) != 0) {
      PyErr_Clear();
      throw pb::type_error("buffer " + std::to_string(i) + " is not a " + (writable ? "writable " : "") +
                           "C-contiguous buffer");
    }
    views_.push_back(view);
  }
}

Buffers::~Buffers() {
  for (auto& v : views_) PyBuffer_Release(&v);
}

std::vector<ConstBuffer> Buffers::as_const() const {
  std::vector<ConstBuffer> out;
  out.reserve(views_.size());
  for (const auto& v : views_) out.push_back({static_cast<const std::byte*>(v.buf), static_cast<size_t>(v.len)});
  return out;
}

std::vector<MutableBuffer> Buffers::as_mutable() const {
  std::vector<MutableBuffer> out;
  out.reserve(views_.size());
  for (const auto& v : views_) out.push_back({static_cast<std::byte*>(v.buf), static_cast<size_t>(v.len)});
  return out;
}

void Raise(const Status& st) {
  const char* name = "TpuSyncError";
  switch (st.code()) {
    case StatusCode::kInvalidArgument: name = "InvalidArgumentError"; break;
    case StatusCode::kNotFound: name = "NotFoundError"; break;
    case StatusCode::kFailedPrecondition: name = "PreconditionError"; break;
    case StatusCode::kResourceExhausted: name = "CapacityError"; break;
    case StatusCode::kDataLoss: name = "CorruptionError"; break;
    case StatusCode::kIoError: name = "StorageIOError"; break;
    case StatusCode::kUnavailable: name = "UnavailableError"; break;
    case StatusCode::kDeadlineExceeded: name = "DeadlineExceededError"; break;
    case StatusCode::kUnauthenticated: name = "AuthError"; break;
    case StatusCode::kMalformed: name = "ProtocolError"; break;
    default: break;
  }
  pb::object cls = pb::module_::import("tpusync.errors").attr(name);
  PyErr_SetString(cls.ptr(), st.message().c_str());
  throw pb::error_already_set();
}

}  // namespace tpusync::py
