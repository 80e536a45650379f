// CUDA graph capture and replay for the worker: the few calls of at::cuda::CUDAGraph that tch does
// not wrap, behind a C interface. No C++ exception crosses it: each call returns null on success
// or an error message the caller frees with rivulet_shim_free_error (see shim_answer.h).
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <exception>
#include <optional>

#include "shim_answer.h"

namespace {

struct Graph {
  at::cuda::CUDAGraph graph;
  // The stream the capture runs on (graphs cannot be captured on the default stream) and the one
  // that was current before, restored when the capture ends.
  std::optional<c10::cuda::CUDAStream> capture_stream;
  std::optional<c10::cuda::CUDAStream> previous_stream;
};

using rivulet_shim::guarded;

}  // namespace

extern "C" {

void* rivulet_graph_new() {
  try {
    return new Graph();
  } catch (...) {
    return nullptr;
  }
}

void rivulet_graph_delete(void* graph) { delete static_cast<Graph*>(graph); }

void rivulet_shim_free_error(char* message) { std::free(message); }

// Makes a side stream of `device` current and starts capturing on it; `pool_source` (may be null)
// is an earlier graph whose memory pool this one shares (graphs replayed one at a time may).
char* rivulet_graph_capture_begin(void* graph, void* pool_source, int device) {
  return guarded([&] {
    auto* g = static_cast<Graph*>(graph);
    g->previous_stream = c10::cuda::getCurrentCUDAStream(device);
    g->capture_stream = c10::cuda::getStreamFromPool(false, device);
    // Nothing queued earlier may run inside the capture.
    c10::cuda::device_synchronize();
    c10::cuda::setCurrentCUDAStream(*g->capture_stream);
    at::cuda::MempoolId_t pool = {0, 0};
    if (pool_source != nullptr) pool = static_cast<Graph*>(pool_source)->graph.pool();
    g->graph.capture_begin(pool);
  });
}

// Ends the capture (instantiating the graph) and makes the earlier stream current again; on an
// error the capture is abandoned and the stream restored all the same.
char* rivulet_graph_capture_end(void* graph) {
  auto* g = static_cast<Graph*>(graph);
  char* error = guarded([&] { g->graph.capture_end(); });
  if (g->previous_stream) c10::cuda::setCurrentCUDAStream(*g->previous_stream);
  return error;
}

// Replays the graph on the current stream, after the work queued there.
char* rivulet_graph_replay(void* graph) {
  return guarded([&] { static_cast<Graph*>(graph)->graph.replay(); });
}

}  // extern "C"
