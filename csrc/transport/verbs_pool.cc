// RDMA verbs provider, the buffer pool's registration hooks (bufferpool.h RegisterHooks): a pool
// buffer is registered with ibv_reg_mr on the opened device (verbs_loader.cc), and each
// registration holds the device open until it is deregistered.
#include "csrc/transport/verbs.h"

#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "csrc/transport/verbs_impl.h"

namespace dtenjax::transport::verbs {

namespace {

Status PoolReg(void*, void* ptr, uint64_t bytes, uint64_t* handle) {
  Device* d = nullptr;
  DTENJAX_RETURN_IF_ERROR(AcquireDevice(&d));
  ibv_mr* mr = d->lib.reg_mr(d->pd, ptr, size_t(bytes),
                             IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                 IBV_ACCESS_REMOTE_READ);
  if (!mr) {
    const int e = errno;
    ReleaseDevice();
    // ENOMEM (and EAGAIN): the device or the pinned-memory limit is out of room, which freeing
    // other regions can cure; anything else (EINVAL, EFAULT, EACCES) is a fault of the request.
    const bool room = e == ENOMEM || e == EAGAIN;
    return DTENJAX_ERROR(room ? Code::kResourceExhausted : Code::kInternal,
                         "ibv_reg_mr of " + std::to_string(bytes) + " bytes failed: " +
                             std::strerror(e) + (room ? "" : " (not a shortage of room)"));
  }
  *handle = reinterpret_cast<uint64_t>(mr);
  return Status::Ok();
}

void PoolDereg(void*, uint64_t handle) {
  const DeregMr dereg = OpenedDeregMr();  // open: this registration holds a reference
  if (dereg && handle) dereg(reinterpret_cast<ibv_mr*>(handle));
  ReleaseDevice();
}

}  // namespace

RegisterHooks PoolHooks() {
  RegisterHooks h;
  h.reg = PoolReg;
  h.dereg = PoolDereg;
  return h;
}

}  // namespace dtenjax::transport::verbs
