// The transport's seams, as the production extension hands them to the test extension
// (custom_calls/testing/): a table of function pointers published as the capsule
// dtenjax._ffi.transport._seams. The test extension changes behaviour only through these;
// dtenjax._ffi itself holds no fault injection and no code path that looks for it.
#pragma once

#include <Python.h>

#include <cstdint>

#include "csrc/common/status.h"
#include "csrc/transport/bufferpool.h"
#include "csrc/transport/comm.h"
#include "csrc/transport/tenancy.h"

namespace dtenjax::transport {

inline constexpr const char* kSeamsCapsule = "dtenjax._ffi.transport._seams";
inline constexpr uint32_t kSeamsVersion = 1;

struct Seams {
  uint32_t version;   // kSeamsVersion of the extension that filled the table
  ThreadSpawner (*swap_thread_spawner)(ThreadSpawner spawner);
  PointerOwnerFn (*swap_pointer_owner_fn)(PointerOwnerFn fn);
  // The BufferPool a Python object of dtenjax._ffi.transport.BufferPool wraps (nullptr if it
  // is not one), and the swap of its registration hooks.
  BufferPool* (*pool_of)(PyObject* pool);
  RegisterHooks (*swap_register_hooks)(BufferPool* pool, RegisterHooks hooks);
  // Raises s as the dtenjax error class of its code (what every binding of dtenjax._ffi raises).
  void (*throw_if_error)(const Status& s);
};

}  // namespace dtenjax::transport
