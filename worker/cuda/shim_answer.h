// How the C++ shims answer across their C interface (graph_shim.cpp, kernel_shim.cpp): no C++
// exception crosses it; each call returns null on success or an error message, allocated here,
// that the caller frees with rivulet_shim_free_error (defined in graph_shim.cpp, which every build
// of the shims has).
#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace rivulet_shim {

inline char* copy_message(const std::string& message) {
  char* copy = static_cast<char*>(std::malloc(message.size() + 1));
  if (copy != nullptr) std::memcpy(copy, message.c_str(), message.size() + 1);
  return copy;
}

// Runs `body`, turning any exception it throws into the shim's answer.
template <typename F>
char* guarded(F&& body) {
  try {
    body();
    return nullptr;
  } catch (const std::exception& error) {
    return copy_message(error.what());
  } catch (...) {
    return copy_message("unknown C++ exception");
  }
}

}  // namespace rivulet_shim
