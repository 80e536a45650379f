// Kernels of our own on CUDA, compiled at run time: NVRTC turns CUDA C++ source into PTX, the
// driver loads it, and launches go on libtorch's current stream (so a CUDA graph being captured
// records them like any libtorch op). Neither library is linked: libnvrtc is opened from beside the
// CUDA runtime libtorch loaded (the `nvidia` wheels), libcuda (the driver) by its soname, both at
// first use, so the worker still starts on machines without them. Behind a C interface that
// answers as shim_answer.h says.
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <dlfcn.h>
#include <nvrtc.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "shim_answer.h"

namespace {

using rivulet_shim::guarded;

[[noreturn]] void fail(const std::string& message) { throw std::runtime_error(message); }

void* symbol(void* library, const char* name) {
  void* found = dlsym(library, name);
  if (found == nullptr) fail(std::string("missing symbol ") + name);
  return found;
}

// NVRTC opens its builtins library (libnvrtc-builtins.so.MAJOR.MINOR) by soname when it compiles;
// outside the library path (the `nvidia` wheels' folder) that fails unless it is loaded already,
// so it is loaded first from NVRTC's own folder. Where that fails, compiling reports it.
void preload_builtins(void* nvrtc) {
  auto version = reinterpret_cast<decltype(&nvrtcVersion)>(dlsym(nvrtc, "nvrtcVersion"));
  void* any_symbol = dlsym(nvrtc, "nvrtcCreateProgram");
  Dl_info info;
  int major = 0, minor = 0;
  if (version == nullptr || version(&major, &minor) != NVRTC_SUCCESS || any_symbol == nullptr ||
      dladdr(any_symbol, &info) == 0 || info.dli_fname == nullptr)
    return;
  std::string path = info.dli_fname;
  std::string folder = path.substr(0, path.find_last_of('/') + 1);
  std::string name = "libnvrtc-builtins.so." + std::to_string(major) + "." + std::to_string(minor);
  if (dlopen((folder + name).c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL);
}

// NVRTC, opened once: from the folder of the CUDA runtime already loaded (PyPI's torch keeps
// libnvrtc beside libcudart), else by soname.
struct Nvrtc {
  decltype(&nvrtcCreateProgram) create;
  decltype(&nvrtcCompileProgram) compile;
  decltype(&nvrtcGetProgramLogSize) log_size;
  decltype(&nvrtcGetProgramLog) log;
  decltype(&nvrtcGetPTXSize) ptx_size;
  decltype(&nvrtcGetPTX) ptx;
  decltype(&nvrtcDestroyProgram) destroy;
  decltype(&nvrtcGetErrorString) error_string;

  static const Nvrtc& get() {
    static const Nvrtc nvrtc = open();
    return nvrtc;
  }

 private:
  static Nvrtc open() {
    std::vector<std::string> candidates;
    Dl_info info;
    void* runtime_symbol = dlsym(RTLD_DEFAULT, "cudaGetDevice");
    if (runtime_symbol != nullptr && dladdr(runtime_symbol, &info) != 0 && info.dli_fname != nullptr) {
      std::string path = info.dli_fname;
      std::string folder = path.substr(0, path.find_last_of('/') + 1);
      candidates.push_back(folder + "libnvrtc.so.13");
      candidates.push_back(folder + "libnvrtc.so.12");
      // CUDA 12's wheels keep each library in a folder of its own (nvidia/cuda_runtime/lib, ...).
      candidates.push_back(folder + "../../cuda_nvrtc/lib/libnvrtc.so.12");
    }
    for (const char* name : {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}) candidates.push_back(name);
    void* library = nullptr;
    for (const auto& candidate : candidates) {
      library = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (library != nullptr) break;
    }
    if (library == nullptr) fail("NVRTC (libnvrtc.so) not found beside the CUDA runtime or on the library path");
    preload_builtins(library);
    Nvrtc n;
    n.create = reinterpret_cast<decltype(n.create)>(symbol(library, "nvrtcCreateProgram"));
    n.compile = reinterpret_cast<decltype(n.compile)>(symbol(library, "nvrtcCompileProgram"));
    n.log_size = reinterpret_cast<decltype(n.log_size)>(symbol(library, "nvrtcGetProgramLogSize"));
    n.log = reinterpret_cast<decltype(n.log)>(symbol(library, "nvrtcGetProgramLog"));
    n.ptx_size = reinterpret_cast<decltype(n.ptx_size)>(symbol(library, "nvrtcGetPTXSize"));
    n.ptx = reinterpret_cast<decltype(n.ptx)>(symbol(library, "nvrtcGetPTX"));
    n.destroy = reinterpret_cast<decltype(n.destroy)>(symbol(library, "nvrtcDestroyProgram"));
    n.error_string = reinterpret_cast<decltype(n.error_string)>(symbol(library, "nvrtcGetErrorString"));
    return n;
  }
};

// The driver API, opened once (the CUDA runtime has loaded it already wherever a GPU works).
struct Driver {
  decltype(&cuModuleLoadData) load_module;
  decltype(&cuModuleGetFunction) get_function;
  decltype(&cuLaunchKernel) launch;
  decltype(&cuGetErrorString) error_string;
  decltype(&cuDeviceGet) get_device;
  decltype(&cuDeviceGetAttribute) get_attribute;
  decltype(&cuDevicePrimaryCtxRetain) retain_primary_context;
  decltype(&cuCtxGetCurrent) get_current_context;
  decltype(&cuCtxSetCurrent) set_current_context;

  static const Driver& get() {
    static const Driver driver = open();
    return driver;
  }

  void check(CUresult result, const char* what) const {
    if (result == CUDA_SUCCESS) return;
    const char* text = nullptr;
    error_string(result, &text);
    fail(std::string(what) + ": " + (text != nullptr ? text : "unknown CUDA driver error"));
  }

 private:
  static Driver open() {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) fail("the CUDA driver (libcuda.so.1) is not loadable");
    Driver d;
    d.load_module = reinterpret_cast<decltype(d.load_module)>(symbol(library, "cuModuleLoadData"));
    d.get_function = reinterpret_cast<decltype(d.get_function)>(symbol(library, "cuModuleGetFunction"));
    d.launch = reinterpret_cast<decltype(d.launch)>(symbol(library, "cuLaunchKernel"));
    d.error_string = reinterpret_cast<decltype(d.error_string)>(symbol(library, "cuGetErrorString"));
    d.get_device = reinterpret_cast<decltype(d.get_device)>(symbol(library, "cuDeviceGet"));
    d.get_attribute = reinterpret_cast<decltype(d.get_attribute)>(symbol(library, "cuDeviceGetAttribute"));
    d.retain_primary_context =
        reinterpret_cast<decltype(d.retain_primary_context)>(symbol(library, "cuDevicePrimaryCtxRetain"));
    d.get_current_context = reinterpret_cast<decltype(d.get_current_context)>(symbol(library, "cuCtxGetCurrent"));
    d.set_current_context = reinterpret_cast<decltype(d.set_current_context)>(symbol(library, "cuCtxSetCurrent"));
    return d;
  }
};

std::string compile_ptx(const char* source, const char* name, const std::vector<std::string>& options) {
  const Nvrtc& nvrtc = Nvrtc::get();
  nvrtcProgram program;
  nvrtcResult created = nvrtc.create(&program, source, name, 0, nullptr, nullptr);
  if (created != NVRTC_SUCCESS) fail(std::string("nvrtcCreateProgram: ") + nvrtc.error_string(created));
  std::vector<const char*> raw;
  for (const auto& option : options) raw.push_back(option.c_str());
  nvrtcResult compiled = nvrtc.compile(program, static_cast<int>(raw.size()), raw.data());
  size_t log_size = 0;
  nvrtc.log_size(program, &log_size);
  std::string log(log_size, '\0');
  if (log_size > 1) nvrtc.log(program, log.data());
  if (compiled != NVRTC_SUCCESS) {
    nvrtc.destroy(&program);
    fail(std::string("NVRTC could not compile ") + name + ": " + nvrtc.error_string(compiled) + "\n" + log);
  }
  size_t ptx_size = 0;
  nvrtc.ptx_size(program, &ptx_size);
  std::string ptx(ptx_size, '\0');
  nvrtc.ptx(program, ptx.data());
  nvrtc.destroy(&program);
  return ptx;
}

std::vector<std::string> split_options(const char* options) {
  std::vector<std::string> parts;
  std::string current;
  for (const char* c = options; *c != '\0'; ++c) {
    if (*c == ' ') {
      if (!current.empty()) parts.push_back(current);
      current.clear();
    } else {
      current.push_back(*c);
    }
  }
  if (!current.empty()) parts.push_back(current);
  return parts;
}

// Makes device `device`'s primary context (the one the CUDA runtime, and so libtorch, computes in)
// current on this thread, where it is not already: the driver API loads modules and launches in
// the current context, which a thread has only once the runtime has done work on it.
// Each device's primary context is retained once, then kept for the process.
void make_primary_context_current(const Driver& driver, int device) {
  static std::mutex lock;
  static std::map<int, CUcontext> primaries;
  CUcontext primary;
  {
    std::lock_guard<std::mutex> guard(lock);
    auto found = primaries.find(device);
    if (found == primaries.end()) {
      CUdevice handle;
      driver.check(driver.get_device(&handle, device), "cuDeviceGet");
      driver.check(driver.retain_primary_context(&primary, handle), "cuDevicePrimaryCtxRetain");
      primaries.emplace(device, primary);
    } else {
      primary = found->second;
    }
  }
  CUcontext current = nullptr;
  driver.check(driver.get_current_context(&current), "cuCtxGetCurrent");
  if (current != primary) driver.check(driver.set_current_context(primary), "cuCtxSetCurrent");
}

}  // namespace

extern "C" {

// Compiles `source` with `options` (space-separated) for a virtual architecture
// (`compute_XY`) and writes the PTX's length to `*ptx_size`, without a GPU: a check that the
// source compiles wherever NVRTC is installed.
char* rivulet_kernel_compile_only(const char* source, const char* name, const char* options, const char* arch,
                                  size_t* ptx_size) {
  return guarded([&] {
    auto parts = split_options(options);
    parts.push_back(std::string("--gpu-architecture=") + arch);
    *ptx_size = compile_ptx(source, name, parts).size();
  });
}

// Compiles `source` with `options` for device `device`'s architecture, loads it into the device's
// primary context and writes kernel `function`'s handle to `*out` (valid as long as the process).
char* rivulet_kernel_load(const char* source, const char* name, const char* options, const char* function,
                          int device, void** out) {
  return guarded([&] {
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
    const Driver& driver = Driver::get();
    make_primary_context_current(driver, device);
    CUdevice handle;
    driver.check(driver.get_device(&handle, device), "cuDeviceGet");
    int major = 0, minor = 0;
    driver.check(driver.get_attribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle), "cuDeviceGetAttribute");
    driver.check(driver.get_attribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle), "cuDeviceGetAttribute");
    auto parts = split_options(options);
    parts.push_back("--gpu-architecture=compute_" + std::to_string(major) + std::to_string(minor));
    std::string ptx = compile_ptx(source, name, parts);
    CUmodule module;
    driver.check(driver.load_module(&module, ptx.c_str()), "cuModuleLoadData");
    CUfunction kernel;
    driver.check(driver.get_function(&kernel, module, function), "cuModuleGetFunction");
    *out = reinterpret_cast<void*>(kernel);
  });
}

// Launches `kernel` on device `device`'s current libtorch stream: a grid of `grid_x × grid_y`
// blocks of `block_x` threads, `args` pointing at each argument's value (cuLaunchKernel's
// convention).
char* rivulet_kernel_launch(void* kernel, int device, unsigned grid_x, unsigned grid_y, unsigned block_x,
                            void** args) {
  return guarded([&] {
    // libtorch's ops restore the thread's device after each one; the driver launches in the
    // current context, which must be this device's.
    const Driver& driver = Driver::get();
    make_primary_context_current(driver, device);
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
    driver.check(driver.launch(reinterpret_cast<CUfunction>(kernel), grid_x, grid_y, 1, block_x, 1, 1, 0,
                               reinterpret_cast<CUstream>(stream), args, nullptr),
                 "cuLaunchKernel");
  });
}

}  // extern "C"
