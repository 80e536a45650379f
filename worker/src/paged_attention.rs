//! Decode attention on CUDA straight over the paged KV cache (`cuda/paged_decode_attention.cu`).
//!
//! libtorch has no attention over paged blocks, so the general path ([`crate::attention`])
//! gathers each sequence's blocks into a dense copy per layer and calls SDPA. For decode steps
//! that gather is half of attention's time and attention most of a large step's GPU time (an H200
//! at 1024 sequences of 256 tokens: 121 of 242 µs per layer; README, "On a GPU"). This kernel
//! reads each key and value once, from where the cache holds it. It is compiled at run time by
//! NVRTC for the model's head size and grouping (`cuda/kernel_shim.cpp`: the worker is built
//! without a CUDA toolkit), and launched on libtorch's current stream, so decode graphs capture it.
//! Where it cannot run (no NVRTC or driver, another dtype, a layout it does not take) attention
//! takes the general path.
//!
//! `unsafe` here is the FFI calls alone. Their invariants: every pointer handed to the shim is
//! live for the call (strings are `CString`s, tensors are held by the caller until the launch is
//! queued; the launch goes on the stream libtorch allocated them for and runs the rest of the
//! step's work on, so their memory is reused only after it, as for libtorch's own kernels); each
//! argument slot points at a value of the type the kernel's parameter has, in its order; the
//! kernel handle comes from a successful `rivulet_kernel_load` and lives as long as the process;
//! an error string the shim returns goes to [`crate::cuda_shim::check`].

use tch::{Device, Kind, Tensor};

/// The kernel's source, compiled at run time.
pub const SOURCE: &str = include_str!("../cuda/paged_decode_attention.cu");
/// Threads per block (the source's `THREADS`).
const THREADS: u32 = 128;
/// Most query heads per KV head: each thread keeps a score and an accumulator per head in
/// registers, and a block's shared memory grows with them.
const MAX_GROUP: usize = 16;
/// A thread block walks its sequence's keys alone, tile after tile; past this many keys it is
/// used only when the step has [`MIN_BLOCKS_FOR_LONG_CONTEXTS`] blocks to spread over the GPU (a
/// few sequences with long contexts attend faster gathered, where libtorch's kernels split the
/// keys between blocks). Measured only up to 256 keys (README, "On a GPU"); the bounds are
/// conservative guesses.
const MAX_KEYS_ALONE: i64 = 1024;
const MIN_BLOCKS_FOR_LONG_CONTEXTS: i64 = 256;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("this build has no CUDA kernel support")]
    Unavailable,
    #[error("paged decode attention does not take head size {head_dim} with {heads} heads over {kv_heads}")]
    Shape {
        head_dim: usize,
        heads: usize,
        kv_heads: usize,
    },
    #[error("paged decode attention: {0}")]
    Cuda(String),
}

#[cfg(rivulet_cuda_kernels)]
mod ffi {
    use std::ffi::{c_char, c_int, c_uint, c_void};

    extern "C" {
        pub fn rivulet_kernel_compile_only(
            source: *const c_char,
            name: *const c_char,
            options: *const c_char,
            arch: *const c_char,
            ptx_size: *mut usize,
        ) -> *mut c_char;
        pub fn rivulet_kernel_load(
            source: *const c_char,
            name: *const c_char,
            options: *const c_char,
            function: *const c_char,
            device: c_int,
            out: *mut *mut c_void,
        ) -> *mut c_char;
        pub fn rivulet_kernel_launch(
            kernel: *mut c_void,
            device: c_int,
            grid_x: c_uint,
            grid_y: c_uint,
            block_x: c_uint,
            args: *mut *mut c_void,
        ) -> *mut c_char;
    }

    pub use crate::cuda_shim::check;

    pub fn c_string(text: &str) -> Result<std::ffi::CString, String> {
        std::ffi::CString::new(text).map_err(|_| format!("{text:?} holds a NUL byte"))
    }
}

/// NVRTC's options for a model's shape: the source's `HEAD_DIM` and `GROUP`.
fn options(head_dim: usize, group: usize) -> String {
    format!("-DHEAD_DIM={head_dim} -DGROUP={group} --std=c++17")
}

/// Where a decode step's keys and values are: the flat caches `[slots, kv_heads, head_dim]`, each
/// sequence's block table row (`tables`, `[n, width]` i64) and its number of keys (`context`, `[n]`
/// i64, at least 1; the kernel reads no further than its table's blocks cover).
#[derive(Clone, Copy)]
pub struct PagedKeys<'a> {
    pub key_cache: &'a Tensor,
    pub value_cache: &'a Tensor,
    pub tables: &'a Tensor,
    pub context: &'a Tensor,
    pub block_size: i64,
}

/// The paged decode kernel, compiled and loaded for one device and one model shape.
pub struct PagedDecodeAttention {
    /// The loaded `CUfunction`, kept as an address (it is a process-wide handle, valid on any
    /// thread of the device's primary context).
    kernel: usize,
    device_index: usize,
    head_dim: i64,
    heads: i64,
    kv_heads: i64,
}

impl PagedDecodeAttention {
    /// Whether the kernel takes this shape: a head size that is a multiple of 8 (16-byte key
    /// loads) dividing the block's threads, whole groups of at most [`MAX_GROUP`] query heads.
    pub fn supports(head_dim: usize, heads: usize, kv_heads: usize) -> bool {
        head_dim > 0
            && head_dim.is_multiple_of(8)
            && (THREADS as usize).is_multiple_of(head_dim)
            && kv_heads > 0
            && heads.is_multiple_of(kv_heads)
            && (1..=MAX_GROUP).contains(&(heads / kv_heads))
    }

    /// Whether a decode group of `sequences` whose longest context is `max_keys` should take the
    /// kernel (see [`MAX_KEYS_ALONE`]).
    pub fn suits(&self, sequences: i64, max_keys: i64) -> bool {
        max_keys <= MAX_KEYS_ALONE || sequences * self.kv_heads >= MIN_BLOCKS_FOR_LONG_CONTEXTS
    }

    /// Compiles and loads the kernel for `device` (CUDA) and the model's head shape.
    pub fn load(device: Device, head_dim: usize, heads: usize, kv_heads: usize) -> Result<Self, KernelError> {
        if !Self::supports(head_dim, heads, kv_heads) {
            return Err(KernelError::Shape {
                head_dim,
                heads,
                kv_heads,
            });
        }
        let Device::Cuda(device_index) = device else {
            return Err(KernelError::Unavailable);
        };
        let kernel = load_kernel(&options(head_dim, heads / kv_heads), device_index)?;
        Ok(Self {
            kernel,
            device_index,
            head_dim: head_dim as i64,
            heads: heads as i64,
            kv_heads: kv_heads as i64,
        })
    }

    /// Attention of one query per sequence: `queries` `[n, heads, head_dim]` (rows may be
    /// strided, heads and dimensions packed) over `cache`, one sequence per query. Returns
    /// `[n, heads, head_dim]`, or `Ok(None)` when the tensors are not in the layout the kernel
    /// takes (bf16 on this device, i64 tables), for the general path.
    pub fn attend(&self, queries: &Tensor, cache: &PagedKeys<'_>, scale: f64) -> Result<Option<Tensor>, KernelError> {
        let PagedKeys {
            key_cache,
            value_cache,
            tables,
            context,
            block_size,
        } = *cache;
        let device = Device::Cuda(self.device_index);
        let (n, heads, dim) = match queries.size3() {
            Ok(shape) => shape,
            Err(_) => return Ok(None),
        };
        let query_strides = queries.stride();
        let packed = |t: &Tensor, kind: Kind| t.device() == device && t.kind() == kind && t.is_contiguous();
        let fits = heads == self.heads
            && dim == self.head_dim
            && queries.device() == device
            && queries.kind() == Kind::BFloat16
            && query_strides[1] == dim
            && query_strides[2] == 1
            && packed(key_cache, Kind::BFloat16)
            && packed(value_cache, Kind::BFloat16)
            && key_cache.size() == value_cache.size()
            && key_cache.size().get(1..) == Some(&[self.kv_heads, self.head_dim][..])
            && (1..=i64::from(i32::MAX)).contains(&block_size)
            && tables.device() == device
            && tables.kind() == Kind::Int64
            && tables.dim() == 2
            && tables.size()[0] == n
            && tables.size()[1] > 0
            && tables.stride()[1] == 1
            && packed(context, Kind::Int64)
            && context.size() == [n]
            // 16-byte key loads: every key row starts 16-byte aligned.
            && (key_cache.data_ptr() as usize).is_multiple_of(16)
            && n > 0;
        if !fits {
            return Ok(None);
        }
        let output = Tensor::empty([n, heads, dim], (Kind::BFloat16, device));
        let launch = Launch {
            queries: queries.data_ptr(),
            query_row_stride: query_strides[0],
            key_cache: key_cache.data_ptr(),
            value_cache: value_cache.data_ptr(),
            tables: tables.data_ptr(),
            table_row_stride: tables.stride()[0],
            context: context.data_ptr(),
            output: output.data_ptr(),
            kv_heads: self.kv_heads as i32,
            block_size: block_size as i32,
            scale: scale as f32,
            table_width: tables.size()[1],
        };
        launch.run(self.kernel, self.device_index, n as u32, self.kv_heads as u32)?;
        Ok(Some(output))
    }
}

/// One launch's arguments, in the kernel's parameter order and types.
#[cfg_attr(not(rivulet_cuda_kernels), allow(dead_code))]
struct Launch {
    queries: *mut std::ffi::c_void,
    query_row_stride: i64,
    key_cache: *mut std::ffi::c_void,
    value_cache: *mut std::ffi::c_void,
    tables: *mut std::ffi::c_void,
    table_row_stride: i64,
    context: *mut std::ffi::c_void,
    output: *mut std::ffi::c_void,
    kv_heads: i32,
    block_size: i32,
    scale: f32,
    table_width: i64,
}

impl Launch {
    #[cfg(rivulet_cuda_kernels)]
    fn run(mut self, kernel: usize, device_index: usize, grid_x: u32, grid_y: u32) -> Result<(), KernelError> {
        use std::ffi::c_void;
        fn slot<T>(value: &mut T) -> *mut c_void {
            (value as *mut T).cast()
        }
        let mut args = [
            slot(&mut self.queries),
            slot(&mut self.query_row_stride),
            slot(&mut self.key_cache),
            slot(&mut self.value_cache),
            slot(&mut self.tables),
            slot(&mut self.table_row_stride),
            slot(&mut self.context),
            slot(&mut self.output),
            slot(&mut self.kv_heads),
            slot(&mut self.block_size),
            slot(&mut self.scale),
            slot(&mut self.table_width),
        ];
        // SAFETY: see the module's invariants: `args` points at this launch's fields, in the
        // kernel's parameter order and types, all live until the call returns (the driver copies
        // them when it queues the launch).
        ffi::check(unsafe {
            ffi::rivulet_kernel_launch(
                kernel as *mut c_void,
                device_index as i32,
                grid_x,
                grid_y,
                THREADS,
                args.as_mut_ptr(),
            )
        })
        .map_err(KernelError::Cuda)
    }

    #[cfg(not(rivulet_cuda_kernels))]
    fn run(self, _kernel: usize, _device_index: usize, _grid_x: u32, _grid_y: u32) -> Result<(), KernelError> {
        Err(KernelError::Unavailable)
    }
}

#[cfg(rivulet_cuda_kernels)]
fn load_kernel(options: &str, device_index: usize) -> Result<usize, KernelError> {
    let text = |s: &str| ffi::c_string(s).map_err(KernelError::Cuda);
    let (source, name, options, function) = (
        text(SOURCE)?,
        text("paged_decode_attention.cu")?,
        text(options)?,
        text("paged_decode_attention")?,
    );
    let mut kernel = std::ptr::null_mut();
    // SAFETY: see the module's invariants: the strings live across the call; `kernel` is written
    // by the shim on success.
    ffi::check(unsafe {
        ffi::rivulet_kernel_load(
            source.as_ptr(),
            name.as_ptr(),
            options.as_ptr(),
            function.as_ptr(),
            device_index as i32,
            &mut kernel,
        )
    })
    .map_err(KernelError::Cuda)?;
    Ok(kernel as usize)
}

#[cfg(not(rivulet_cuda_kernels))]
fn load_kernel(_options: &str, _device_index: usize) -> Result<usize, KernelError> {
    Err(KernelError::Unavailable)
}

/// Compiles the kernel for a shape and a virtual architecture (`compute_90`) without a GPU, and
/// returns its PTX's length: whether NVRTC accepts the source wherever NVRTC is installed.
pub fn compile_only(head_dim: usize, group: usize, arch: &str) -> Result<usize, KernelError> {
    #[cfg(rivulet_cuda_kernels)]
    {
        let text = |s: &str| ffi::c_string(s).map_err(KernelError::Cuda);
        let (source, name, options, arch) = (
            text(SOURCE)?,
            text("paged_decode_attention.cu")?,
            text(&options(head_dim, group))?,
            text(arch)?,
        );
        let mut size = 0usize;
        // SAFETY: see the module's invariants: the strings live across the call; `size` is written
        // by the shim on success.
        ffi::check(unsafe {
            ffi::rivulet_kernel_compile_only(
                source.as_ptr(),
                name.as_ptr(),
                options.as_ptr(),
                arch.as_ptr(),
                &mut size,
            )
        })
        .map_err(KernelError::Cuda)?;
        Ok(size)
    }
    #[cfg(not(rivulet_cuda_kernels))]
    {
        let _ = (head_dim, group, arch, options);
        Err(KernelError::Unavailable)
    }
}

/// Whether this build can compile and launch kernels of its own (a CUDA torch with the CUDA
/// runtime's headers).
pub const fn supported() -> bool {
    cfg!(rivulet_cuda_kernels)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC accepts the source for SmolLM2's shape (64, groups of 3) and for other shapes the
    /// kernel takes, on Ampere's and Hopper's virtual architectures. Needs no GPU; skipped, saying
    /// so, where the build has no CUDA torch.
    #[test]
    fn the_kernel_compiles_for_the_shapes_it_takes() {
        if !supported() {
            eprintln!("skipped: this build has no CUDA kernel support");
            return;
        }
        for (head_dim, group) in [(64, 3), (128, 4), (64, 1), (32, 8), (128, MAX_GROUP)] {
            assert!(PagedDecodeAttention::supports(head_dim, 3 * group, 3));
            for arch in ["compute_80", "compute_90"] {
                let ptx = compile_only(head_dim, group, arch).unwrap_or_else(|error| panic!("{error}"));
                assert!(ptx > 1000, "{head_dim}/{group} on {arch}: {ptx} bytes of PTX");
            }
        }
    }

    #[test]
    fn shapes_outside_the_kernel_are_refused() {
        assert!(PagedDecodeAttention::supports(64, 9, 3));
        assert!(!PagedDecodeAttention::supports(96, 9, 3)); // does not divide 128 threads
        assert!(!PagedDecodeAttention::supports(12, 9, 3)); // not a multiple of 8
        assert!(!PagedDecodeAttention::supports(64, 9, 2)); // partial groups
        assert!(!PagedDecodeAttention::supports(64, 9, 0));
        assert!(!PagedDecodeAttention::supports(64, 64, 2)); // groups of 32: past MAX_GROUP
    }
}
