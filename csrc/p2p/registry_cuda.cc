// Process-wide registry of symmetric regions and communicators (see registry.h). Host code that
// calls the CUDA runtime, no device code: compiled by the C++ compiler, not nvcc (CMakeLists.txt).
#include "csrc/p2p/registry.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>
#include <string>
#include <utility>

namespace dtenjax::p2p {
namespace {

struct Region {
  char* base = nullptr;
  size_t capacity = 0;
  uint32_t* error_host = nullptr;
  uint32_t* error_dev = nullptr;
  Descriptor desc{};
};

struct Registry {
  std::mutex mu;
  std::map<int, Region> regions;                                 // by ordinal
  std::map<std::pair<int, uint64_t>, Comm> comms;                 // by (ordinal, key)
  std::map<std::pair<int, uint64_t>, std::string> comm_sig;       // descriptors connected
  std::vector<std::pair<int, const uint32_t*>> watched;            // error words, by ordinal
  std::map<uint64_t, void*> ipc_opened;                           // by region base in peer, per pid
  std::map<const uint32_t*, int> reported;                         // timeouts already logged
};

Registry& Reg() {
  static Registry* r = new Registry();  // never destroyed: kernels may run until process exit
  return *r;
}

uint64_t HostHash() {
  char name[256] = {0};
  gethostname(name, sizeof(name) - 1);
  return std::hash<std::string>()(std::string(name));
}

// Runs fn with `ordinal` as the current device, restoring the previous one.
template <typename F>
Status OnDevice(int ordinal, F fn) {
  int prev = 0;
  DTENJAX_CUDA_CHECK(cudaGetDevice(&prev));
  DTENJAX_CUDA_CHECK(cudaSetDevice(ordinal));
  Status s = fn();
  const cudaError_t restored = cudaSetDevice(prev);
  DTENJAX_RETURN_IF_ERROR(s);
  DTENJAX_CUDA_CHECK_AS(restored, Code::kInternal,
                        "cudaSetDevice (restoring the caller's device) failed");
  return Status::Ok();
}

void FreeRegion(char* base, uint32_t* err_host) {
  if (base != nullptr) cudaFree(base);
  if (err_host != nullptr) cudaFreeHost(err_host);
  cudaGetLastError();  // clean-up on an error path: the first error is the one reported
}

// Allocates a zeroed region on the current device.
Status AllocRegionHere(size_t capacity, char** base) {
  const size_t bytes = RegionBytes(capacity);
  void* p = nullptr;
  DTENJAX_CUDA_CHECK_AS(cudaMalloc(&p, bytes), Code::kResourceExhausted,
                        "p2p: cannot allocate the " + std::to_string(bytes) +
                            "-byte symmetric region (lower DTENJAX_P2P_BUFFER_BYTES)");
  Status s = [&]() -> Status {
    // Zero flags and counters once; they are never reset afterwards.
    DTENJAX_CUDA_CHECK(cudaMemset(p, 0, bytes));
    DTENJAX_CUDA_CHECK(cudaDeviceSynchronize());
    return Status::Ok();
  }();
  if (!s.ok()) {
    FreeRegion(static_cast<char*>(p), nullptr);
    return s;
  }
  *base = static_cast<char*>(p);
  return Status::Ok();
}

// Allocates zeroed host-mapped error words for kernels on the current device.
Status AllocErrorWordsHere(uint32_t** err_host, uint32_t** err_dev) {
  void* h = nullptr;
  DTENJAX_CUDA_CHECK(cudaHostAlloc(&h, kErrorWords * sizeof(uint32_t), cudaHostAllocMapped));
  std::memset(h, 0, kErrorWords * sizeof(uint32_t));
  void* d = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&d, h, 0);
  if (e != cudaSuccess) FreeRegion(nullptr, static_cast<uint32_t*>(h));
  DTENJAX_CUDA_CHECK(e);
  *err_host = static_cast<uint32_t*>(h);
  *err_dev = static_cast<uint32_t*>(d);
  return Status::Ok();
}

std::string TimeoutMessage(int ordinal, const volatile uint32_t* e) {
  return "p2p all-reduce on device " + std::to_string(ordinal) + ": rank " + std::to_string(e[1]) +
         " waited past DTENJAX_COLLECTIVE_TIMEOUT for rank " + std::to_string(e[2]) +
         " to reach barrier " + std::to_string(e[3]) +
         " and trapped (the step fails with a CUDA error; a peer did not enter the same "
         "collective). Check that every rank runs the same collectives in the same order, or "
         "raise DTENJAX_COLLECTIVE_TIMEOUT";
}

// A detached thread that reports kernel timeouts as they happen: the trapping kernel fails its
// step with a bare CUDA error, so this line is what says which rank waited for which.
void WatchTimeouts();

void StartWatchdog() {
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      std::thread(WatchTimeouts).detach();
    } catch (const std::exception&) {
      // No watchdog thread: timeouts are still reported by the next call (CheckKernelError).
    }
  });
}

}  // namespace

Status RegisterRegion(int ordinal, size_t capacity, Descriptor* out) {
  DTENJAX_CHECK_ARG(capacity > 0 && capacity % kVectorBytes == 0,
                    "p2p: buffer bytes " + std::to_string(capacity) +
                        " must be a positive multiple of " + std::to_string(kVectorBytes) +
                        " (DTENJAX_P2P_BUFFER_BYTES)");
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.regions.find(ordinal);
  if (it != reg.regions.end()) {
    if (it->second.capacity != capacity) {
      return DTENJAX_ERROR(Code::kInvalidArgument,
                           "p2p: device " + std::to_string(ordinal) + " already has a " +
                               std::to_string(it->second.capacity) +
                               "-byte registered buffer; asked for " + std::to_string(capacity) +
                               " (DTENJAX_P2P_BUFFER_BYTES must not change within a process)");
    }
    *out = it->second.desc;
    return Status::Ok();
  }
  Region r;
  r.capacity = capacity;
  DTENJAX_RETURN_IF_ERROR(OnDevice(ordinal, [&]() -> Status {
    DTENJAX_RETURN_IF_ERROR(AllocRegionHere(capacity, &r.base));
    const Status words = AllocErrorWordsHere(&r.error_host, &r.error_dev);
    if (!words.ok()) FreeRegion(r.base, nullptr);
    DTENJAX_RETURN_IF_ERROR(words);
    std::memset(&r.desc, 0, sizeof(r.desc));
    r.desc.magic = kDescriptorMagic;
    r.desc.pid = static_cast<int64_t>(getpid());
    r.desc.host = HostHash();
    r.desc.ordinal = ordinal;
    r.desc.base = reinterpret_cast<uint64_t>(r.base);
    r.desc.capacity = capacity;
    r.desc.ipc_ok = cudaIpcGetMemHandle(&r.desc.handle, r.base) == cudaSuccess ? 1 : 0;
    cudaGetLastError();  // an IPC failure only matters to other processes; Connect reports it
    return Status::Ok();
  }));
  reg.regions[ordinal] = r;
  reg.watched.emplace_back(ordinal, r.error_host);
  *out = r.desc;
  StartWatchdog();
  return Status::Ok();
}

Status Connect(int ordinal, uint64_t key, int rank, int world, const Descriptor* all) {
  DTENJAX_CHECK_ARG(world >= 1 && world <= kMaxRanks,
                    "p2p: world size " + std::to_string(world) + " is outside [1, " +
                        std::to_string(kMaxRanks) + "]");
  DTENJAX_CHECK_ARG(rank >= 0 && rank < world,
                    "p2p: rank " + std::to_string(rank) + " is outside [0, " +
                        std::to_string(world) + ")");
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  const auto id = std::make_pair(ordinal, key);
  const std::string sig(reinterpret_cast<const char*>(all), sizeof(Descriptor) * world);
  if (reg.comms.count(id)) {
    if (reg.comm_sig[id] == sig) return Status::Ok();
    return DTENJAX_ERROR(Code::kInvalidArgument,
                         "p2p: communicator " + std::to_string(key) + " of device " +
                             std::to_string(ordinal) + " was connected to other peers before");
  }
  auto rit = reg.regions.find(ordinal);
  if (rit == reg.regions.end()) {
    return DTENJAX_ERROR(Code::kUnavailable, "p2p: device " + std::to_string(ordinal) +
                                                 " has no registered buffer; register it first");
  }
  const Region& mine = rit->second;
  const int64_t pid = getpid();
  const uint64_t host = HostHash();
  Comm c;
  c.world = world;
  c.rank = rank;
  c.capacity = mine.capacity;
  c.error_host = mine.error_host;
  c.error_dev = mine.error_dev;
  for (int p = 0; p < world; ++p) {
    const Descriptor& d = all[p];
    DTENJAX_CHECK_ARG(d.magic == kDescriptorMagic,
                      "p2p: descriptor of rank " + std::to_string(p) + " is corrupt");
    DTENJAX_CHECK_ARG(d.capacity == mine.capacity,
                      "p2p: rank " + std::to_string(p) + " registered " +
                          std::to_string(d.capacity) + " bytes, this rank " +
                          std::to_string(mine.capacity) +
                          "; set the same DTENJAX_P2P_BUFFER_BYTES on every process");
    if (d.host != host) {
      return DTENJAX_ERROR(Code::kUnavailable,
                           "p2p: rank " + std::to_string(p) +
                               " is on another host; NVLink peer-to-peer needs one host "
                               "(use algorithm='xla')");
    }
    if (d.pid == pid) {
      if (d.ordinal != ordinal) {
        int can = 0;
        DTENJAX_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, ordinal, d.ordinal));
        if (!can) {
          return DTENJAX_ERROR(Code::kUnavailable,
                               "p2p: device " + std::to_string(ordinal) +
                                   " cannot access device " + std::to_string(d.ordinal) +
                                   " peer-to-peer (no NVLink/PCIe P2P path; use algorithm='xla')");
        }
        DTENJAX_RETURN_IF_ERROR(OnDevice(ordinal, [&]() -> Status {
          cudaError_t e = cudaDeviceEnablePeerAccess(d.ordinal, 0);
          if (e == cudaErrorPeerAccessAlreadyEnabled) {
            (void)cudaGetLastError();   // not an error here: clear it
            e = cudaSuccess;
          }
          DTENJAX_CUDA_CHECK_AS(e, Code::kUnavailable, "p2p: cudaDeviceEnablePeerAccess failed");
          return Status::Ok();
        }));
      }
      c.peers.region[p] = reinterpret_cast<char*>(d.base);
    } else {
      if (!d.ipc_ok) {
        return DTENJAX_ERROR(Code::kUnavailable,
                             "p2p: rank " + std::to_string(p) +
                                 " could not export a CUDA IPC handle for its buffer "
                                 "(use algorithm='xla')");
      }
      void*& opened = reg.ipc_opened[d.base ^ static_cast<uint64_t>(d.pid) << 48];
      if (opened == nullptr) {
        DTENJAX_RETURN_IF_ERROR(OnDevice(ordinal, [&]() -> Status {
          const cudaError_t e =
              cudaIpcOpenMemHandle(&opened, d.handle, cudaIpcMemLazyEnablePeerAccess);
          if (e != cudaSuccess) opened = nullptr;
          DTENJAX_CUDA_CHECK_AS(e, Code::kUnavailable,
                                "p2p: cudaIpcOpenMemHandle of rank " + std::to_string(p) +
                                    " failed (use algorithm='xla')");
          return Status::Ok();
        }));
      }
      c.peers.region[p] = static_cast<char*>(opened);
    }
  }
  DTENJAX_CHECK_ARG(c.peers.region[rank] == mine.base,
                    "p2p: descriptor of rank " + std::to_string(rank) +
                        " is not this device's buffer (ranks out of order?)");
  reg.comms[id] = c;
  reg.comm_sig[id] = sig;
  return Status::Ok();
}

Status FindComm(int ordinal, uint64_t key, Comm* out) {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.comms.find(std::make_pair(ordinal, key));
  if (it == reg.comms.end()) {
    return DTENJAX_ERROR(Code::kUnavailable,
                         "p2p: device " + std::to_string(ordinal) + " has no communicator " +
                             std::to_string(key) +
                             "; call dtenjax's p2p.all_reduce (it connects before tracing)");
  }
  *out = it->second;
  return Status::Ok();
}

Status CheckKernelError(int ordinal, const uint32_t* error_host, const char* what) {
  if (error_host == nullptr) return Status::Ok();
  const volatile uint32_t* e = error_host;
  if (e[0] == 0) return Status::Ok();
  return DTENJAX_ERROR(Code::kDeadlineExceeded,
                       std::string(what) + ": an earlier " + TimeoutMessage(ordinal, e));
}

std::vector<std::string> KernelTimeouts() {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  std::vector<std::string> out;
  for (const auto& [ordinal, words] : reg.watched) {
    const volatile uint32_t* e = words;
    if (e[0] != 0) out.push_back(TimeoutMessage(ordinal, e));
  }
  return out;
}

namespace {
void WatchTimeouts() {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::vector<std::pair<int, const uint32_t*>> fresh;
    {
      Registry& reg = Reg();
      std::lock_guard<std::mutex> lock(reg.mu);
      auto scan = [&](int ordinal, const uint32_t* words) {
        const volatile uint32_t* e = words;
        if (e != nullptr && e[0] != 0 && reg.reported.emplace(words, ordinal).second) {
          fresh.emplace_back(ordinal, words);
        }
      };
      for (const auto& [ordinal, words] : reg.watched) scan(ordinal, words);
    }
    for (const auto& [ordinal, words] : fresh) {
      std::fprintf(stderr, "dtenjax: %s\n", TimeoutMessage(ordinal, words).c_str());
      std::fflush(stderr);
    }
  }
}
}  // namespace

Status AllocRegionOn(int ordinal, size_t capacity, char** base) {
  DTENJAX_CHECK_ARG(capacity > 0 && capacity % 16 == 0,
                    "p2p: region capacity " + std::to_string(capacity) +
                        " must be a positive multiple of 16");
  return OnDevice(ordinal, [&]() -> Status { return AllocRegionHere(capacity, base); });
}

Status AllocErrorWords(int ordinal, uint32_t** host, uint32_t** dev) {
  DTENJAX_RETURN_IF_ERROR(
      OnDevice(ordinal, [&]() -> Status { return AllocErrorWordsHere(host, dev); }));
  Registry& reg = Reg();
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    reg.watched.emplace_back(ordinal, *host);
  }
  StartWatchdog();
  return Status::Ok();
}

}  // namespace dtenjax::p2p
