//! Activation rows times a panel ([`Panels`]) on Intel AMX tiles, sixteen activation rows a
//! tile. Part of [`super`]'s `unsafe`, under its invariants, and these of its own:
//! - the functions here run only after [`has_amx`] returned true: the CPU has AMX-TILE,
//!   AMX-BF16, AVX-512BW and AVX512-BF16, and Linux granted this process the tile state;
//! - every tile instruction runs inside [`Tiles::with`], which loads this module's one tile
//!   configuration on the calling thread before and releases the tiles after; each `asm!` block
//!   zeroes or loads every tile it reads, so no tile's contents are relied on across blocks, and
//!   nothing else in the program uses tiles (the compiler never does);
//! - unlike the rest of `simd`, some loads and stores here are aligned: they touch only the
//!   per-thread buffers made of 64-byte-aligned [`Line`]s, at multiples of 64 bytes.
//!
//! Why: a step of many rows is bound by f32 FMAs (~220 GFLOP/s on two cores with AVX-512),
//! while one `tdpbf16ps` does 16×16×32 multiply-adds (measured: 64 rows of Q4_1 projections
//! 62 → 33 ms). bf16 keeps only 8 significant bits, so nothing is rounded that f32 would keep
//! exactly:
//! - the weights enter as their integer quants `q` (0..15, or -128..127 for Q8_0), exact in
//!   bf16, and each block's `d` and offset are applied afterwards in f32, as in
//!   [`super::panel_gemv`]: `Σ (d·q + offset)·x = d·Σ q·x + offset·Σ x`;
//! - each activation is split into three bf16, `x = hi + mid + lo + ε`, each the nearest bf16 to
//!   what the ones before left, so `|ε| ≤ 2⁻²⁴·|x|`: the 24 significant bits of f32 (two
//!   parts keep 16, which moved a one-block product by up to 6e-5 of its value). Products of
//!   bf16 are exact in f32 and the tile sums them in f32, so the result is an f32 product to
//!   within a few ulps of the terms' magnitude, like the FMA paths (the kernel tests hold it to
//!   the same tolerance).
//!
//! Layout: an activation matrix is split once per product into `hi`, `mid` and `lo` tiles of
//! bf16 ([`SplitActivations`], padded to whole tiles with zero rows); each panel block's quants are
//! widened in registers into a 1 KiB tile in AMX's pair layout (row `p` holds, for each of the 16
//! weight rows `n`, the quants of columns `2p` and `2p + 1`), once per panel for every
//! activation tile.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::panels::{Kind, Panels, Q4_BLOCK, Q8_BLOCK, SCALES};
use super::{fits, has_avx512, SharedOutput, PANEL};

mod split;
pub use split::SplitActivations;
use split::{bf16_bits, A_BLOCK};

/// Activation rows per tile.
pub const TILE_ROWS: usize = 16;

/// Bytes of one block's widened quants: 16 pair rows of 64 bytes.
const B_TILE_BYTES: usize = 1024;

/// Whether the AMX path runs here (detected once; `RIVULET_KERNELS_NO_AMX=1` keeps to the
/// AVX-512 one, to compare them). Asks Linux for the tile state on first use.
pub fn has_amx() -> bool {
    use std::sync::OnceLock;
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        if !has_avx512() || std::env::var_os("RIVULET_KERNELS_NO_AMX").is_some() {
            return false;
        }
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
            let leaf7 = __cpuid_count(7, 0);
            let amx = leaf7.edx & (1 << 22) != 0 && leaf7.edx & (1 << 24) != 0;
            amx && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512bf16")
                && request_tile_state()
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            false
        }
    })
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: without it the first tile
/// instruction faults. The permission covers every thread of the process.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_state() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let result: i64;
    // SAFETY: the `arch_prctl` system call with a request that only widens this process's
    // permitted xsave state; it reads and writes no memory of ours.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => result,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    result == 0
}

/// A 64-byte-aligned line: tile loads and stores are fastest aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Per-thread buffers of the AMX path.
#[derive(Default)]
struct Scratch {
    /// The panel's widened quants, one [`B_TILE_BYTES`] tile per block.
    b_tiles: Vec<Line>,
    /// Two tiles' worth of f32 results (`[2][16][16]`).
    results: Vec<Line>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// The tile configuration every kernel here runs under: palette 1, all eight tiles 16 rows of
/// 64 bytes.
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

/// The tiles, configured on the calling thread for the length of one call.
pub struct Tiles;

thread_local! {
    /// Whether this thread is inside [`Tiles::with`] (the kernels check it before any tile
    /// instruction: outside, the tiles are not configured and the instructions fault).
    static CONFIGURED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Releases the tiles when [`Tiles::with`] ends, returned or unwound.
struct Release;

impl Drop for Release {
    fn drop(&mut self) {
        CONFIGURED.set(false);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AMX present and permitted (`Tiles::with` asserted it before making this
        // guard); returns the tiles to their initial state, and no tile is live past this point.
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem));
        }
    }
}

impl Tiles {
    /// Runs `work` with the tiles configured on this thread, and releases them after (so that
    /// a context switch need not save them), also if `work` panics.
    pub fn with<R>(work: impl FnOnce() -> R) -> R {
        assert!(has_amx());
        assert!(!CONFIGURED.get(), "Tiles::with is not reentrant");
        let mut config = Config {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        // Palette 1 has eight tiles; the entries past them must stay zero.
        config.bytes_per_row[..8].fill(64);
        config.rows[..8].fill(16);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AMX present and permitted (asserted); `config` is a valid palette-1
        // configuration (8 tiles of 16 rows × 64 bytes, reserved bytes zero), 64 bytes long.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
        }
        let _release = Release;
        CONFIGURED.set(true);
        work()
    }
}

/// Panels one call of [`Panels::product_amx`] multiplies at most: each activation tile loaded
/// onto the tiles serves that many panels' products.
///
/// Why: with one panel a call, every block of every activation tile loaded its three activation
/// parts for sixteen columns' products (a layer's down projection, 1536 values a row, reads
/// 144 KiB of parts a tile, from L2, for each panel). Two panels a call halve those loads and
/// alternate two panels' products on the tile unit. On the 2-vCPU Xeon of the README's
/// twenty-third round (`rivulet-worker-bench` at context 256, three alternations): a 32-sequence
/// step 44.5 / 44.5 / 43.0 → 41.6 / 43.7 / 41.5 ms (down 5.8–6.5 → 5.1–5.3), a 64-sequence one
/// 78.0 / 79.3 / 81.3 → 75.3 / 76.4 / 75.5 (gate+up 14.1–15.5 → 12.8–13.7, the head 8.0–8.7 →
/// 7.0–7.5). Three panels a call (seven tiles, one set) measured slower, likely because three
/// panels' f32 totals (48 vectors) no longer fit the registers: at 32 sequences the head 4.4–4.6
/// → 5.4–5.7 ms, qkv 3.0 → 4.4–4.8 (its 60 panels also split unevenly by threes).
pub const AMX_PANELS: usize = 2;

impl Panels {
    /// `out[b][first_column + 16·i + r] = Σ_k x[b][k] · w[(panels.start + i) · PANEL + r][k]` for
    /// every row `b` of `acts`, every panel `i` of `panels` (at most [`AMX_PANELS`]) and
    /// `16·i + r < columns` (the panels' real rows: only the last may be partial), written
    /// straight into `out`. Must run inside [`Tiles::with`]; the caller owns those columns of
    /// `out` (the [`SharedOutput`] invariant).
    pub fn product_amx(
        &self,
        panels: std::ops::Range<usize>,
        acts: &SplitActivations,
        out: &SharedOutput,
        first_column: usize,
        columns: usize,
    ) {
        assert!(has_amx() && CONFIGURED.get(), "product_amx runs inside Tiles::with");
        let count = panels.len();
        assert!((1..=AMX_PANELS).contains(&count));
        let blocks = self.blocks_per_row();
        // `matmul` takes another path for empty rows: the first block's products run unguarded.
        assert!(blocks > 0);
        assert_eq!(acts.blocks, blocks);
        assert!(columns > (count - 1) * PANEL && columns <= count * PANEL);
        assert!(fits(out.columns, first_column.checked_add(columns)));
        assert_eq!(out.batch, acts.rows);
        // The panels' blocks (a lone panel's twice: only the first `count` are read).
        let sources: [&[u8]; AMX_PANELS] =
            std::array::from_fn(|i| self.blocks(panels.start + i.min(count - 1), 0..blocks));
        SCRATCH.with_borrow_mut(|scratch| {
            scratch
                .b_tiles
                .resize(count * blocks * B_TILE_BYTES / 64, Line([0; 64]));
            scratch
                .results
                .resize(RESULT_TILES * TILE_ROWS * PANEL * 4 / 64, Line([0; 64]));
            for (panel, source) in sources.iter().take(count).enumerate() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX-512BW present (`has_amx`); `source` holds `blocks` blocks of this
                // kind and `b_tiles` `blocks` widened tiles from `panel · blocks` (sized above).
                unsafe {
                    let tiles = scratch
                        .b_tiles
                        .as_mut_ptr()
                        .cast::<u8>()
                        .add(panel * blocks * B_TILE_BYTES);
                    match self.kind() {
                        Kind::Q4 => widen_q4(source.as_ptr(), blocks, tiles),
                        Kind::Q8 => widen_q8(source.as_ptr(), blocks, tiles),
                    }
                }
            }
            let kernel = match count {
                1 => tile_product::<1>,
                _ => tile_product::<2>,
            };
            for tile in 0..acts.tiles() {
                let first = tile * TILE_ROWS;
                #[cfg(target_arch = "x86_64")]
                // SAFETY: inside `Tiles::with` (caller); `acts` holds `blocks` split blocks and
                // block sums for each of its tiles (its constructor), `b_tiles` `blocks` tiles per
                // panel, `results` `RESULT_TILES` result tiles; `out` has `acts.rows` rows of
                // `out.columns`, of which `first_column..first_column + columns` are this task's
                // (asserted above).
                unsafe {
                    kernel(
                        self.kind(),
                        sources.map(<[u8]>::as_ptr),
                        blocks,
                        acts.tiles_data[tile * blocks * A_BLOCK / 32..].as_ptr().cast(),
                        scratch.b_tiles.as_ptr().cast(),
                        scratch.results.as_mut_ptr().cast(),
                        acts.sums.as_ptr().add(tile * blocks * TILE_ROWS),
                        TILE_ROWS.min(acts.rows - first),
                        Destination {
                            first: out.ptr.add(first * out.columns + first_column),
                            stride: out.columns,
                            columns,
                        },
                    );
                }
            }
        });
    }
}

/// Result tiles in flight: a block's, for each panel, while the next block's products run.
const RESULT_TILES: usize = 2 * AMX_PANELS;

/// Where a tile's results go: `rows` rows `stride` apart from `first`, `columns` values each.
#[derive(Clone, Copy)]
struct Destination {
    first: *mut f32,
    stride: usize,
    columns: usize,
}

/// `index & 31 → bf16(index & 15)`: a widened nibble's bf16, whatever the bit above it holds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn nibble_table() -> __m512i {
    let mut table = [0u16; 32];
    for (i, t) in table.iter_mut().enumerate() {
        *t = bf16_bits((i & 15) as f32);
    }
    // SAFETY: 64 bytes read from a 64-byte array.
    unsafe { _mm512_loadu_si512(table.as_ptr().cast()) }
}

/// Widens `blocks` Q4 panel blocks' nibbles into pair-layout bf16 tiles.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen_q4(source: *const u8, blocks: usize, tiles: *mut u8) {
    // SAFETY (whole body): `source` holds `blocks` Q4 blocks and `tiles` `blocks` tiles (caller).
    unsafe {
        let table = nibble_table();
        for block in 0..blocks {
            let nibbles = source.add(block * Q4_BLOCK + 2 * SCALES);
            let tile = tiles.add(block * B_TILE_BYTES);
            for p in 0..8 {
                // Columns 2p and 2p + 1 (low nibbles), 2p + 16 and 2p + 17 (high), of rows 0..16,
                // already alternating byte by byte as the tiles pair them.
                let pairs = _mm256_loadu_si256(nibbles.add(2 * PANEL * p).cast());
                let words = _mm512_cvtepu8_epi16(pairs);
                _mm512_store_si512(tile.add(64 * p).cast(), _mm512_permutexvar_epi16(words, table));
                let high = _mm512_srli_epi16::<4>(words);
                _mm512_store_si512(tile.add(64 * (p + 8)).cast(), _mm512_permutexvar_epi16(high, table));
            }
        }
    }
}

/// Widens `blocks` Q8_0 panel blocks' quants into pair-layout bf16 tiles.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn widen_q8(source: *const u8, blocks: usize, tiles: *mut u8) {
    // SAFETY (whole body): `source` holds `blocks` Q8 blocks and `tiles` `blocks` tiles (caller).
    unsafe {
        for block in 0..blocks {
            let values = source.add(block * Q8_BLOCK + SCALES);
            let tile = tiles.add(block * B_TILE_BYTES);
            for p in 0..16 {
                let a = _mm_loadu_si128(values.add(PANEL * 2 * p).cast());
                let b = _mm_loadu_si128(values.add(PANEL * (2 * p + 1)).cast());
                let rows_low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(a, b)));
                let rows_high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(a, b)));
                // Exact: an integer of magnitude ≤ 128 has at most 8 significant bits.
                let widened = _mm512_cvtne2ps_pbh(rows_high, rows_low);
                _mm512_store_si512(
                    tile.add(64 * p).cast(),
                    std::mem::transmute::<__m512bh, __m512i>(widened),
                );
            }
        }
    }
}

/// Runs one block's products for one activation tile and `P` panels (1 or 2):
/// `results[i] = hi·q_i + mid·q_i + lo·q_i`, `[16][16]` f32 each, summed in that order (the
/// same sums whatever `P`, bit for bit).
///
/// One panel runs on tile-register set `SET` (0: `tmm0..tmm3`, 1: `tmm4..tmm7`; `lo` reloads
/// the tile `hi` used once its product has read it): two sets in turn let one block's products
/// run while the block before is stored and scaled. Two panels take six tiles, one set:
/// results on `tmm0` and `tmm1`, quants on `tmm4` and `tmm5`, the activation parts on `tmm3`
/// and `tmm7` (`mid` has a tile of its own, so that its load need not wait for `hi`'s
/// products).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block_products<const P: usize, const SET: usize>(a: *const u16, b: [*const u8; P], results: [*mut f32; P]) {
    // SAFETY: inside `Tiles::with` (caller); `a` holds a block's `hi`, `mid` and `lo` tiles
    // (1 KiB each, rows 64 bytes apart), each `b` a panel's widened quants and each of `results`
    // 1 KiB.
    unsafe {
        macro_rules! one_panel {
            ($c:literal, $first:literal, $second:literal, $q:literal) => {
                std::arch::asm!(
                    concat!("tilezero ", $c),
                    concat!("tileloadd ", $q, ", [{b} + {s64}*1]"),
                    concat!("tileloadd ", $first, ", [{a} + {s64}*1]"),
                    concat!("tileloadd ", $second, ", [{a} + {s64}*1 + 1024]"),
                    concat!("tdpbf16ps ", $c, ", ", $first, ", ", $q),
                    concat!("tdpbf16ps ", $c, ", ", $second, ", ", $q),
                    concat!("tileloadd ", $first, ", [{a} + {s64}*1 + 2048]"),
                    concat!("tdpbf16ps ", $c, ", ", $first, ", ", $q),
                    concat!("tilestored [{r} + {s64}*1], ", $c),
                    a = in(reg) a,
                    b = in(reg) b[0],
                    r = in(reg) results[0],
                    s64 = in(reg) 64usize,
                    options(nostack),
                )
            };
        }
        if P == 1 && SET == 0 {
            one_panel!("tmm0", "tmm1", "tmm2", "tmm3");
        } else if P == 1 {
            one_panel!("tmm4", "tmm5", "tmm6", "tmm7");
        } else {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tileloadd tmm3, [{a} + {s64}*1]",
                "tileloadd tmm4, [{b0} + {s64}*1]",
                "tileloadd tmm5, [{b1} + {s64}*1]",
                "tileloadd tmm7, [{a} + {s64}*1 + 1024]",
                "tdpbf16ps tmm0, tmm3, tmm4",
                "tdpbf16ps tmm1, tmm3, tmm5",
                "tdpbf16ps tmm0, tmm7, tmm4",
                "tdpbf16ps tmm1, tmm7, tmm5",
                "tileloadd tmm3, [{a} + {s64}*1 + 2048]",
                "tdpbf16ps tmm0, tmm3, tmm4",
                "tdpbf16ps tmm1, tmm3, tmm5",
                "tilestored [{r0} + {s64}*1], tmm0",
                "tilestored [{r1} + {s64}*1], tmm1",
                a = in(reg) a,
                b0 = in(reg) b[0],
                b1 = in(reg) b[P - 1],
                r0 = in(reg) results[0],
                r1 = in(reg) results[P - 1],
                s64 = in(reg) 64usize,
                options(nostack),
            );
        }
    }
}

/// `acc[m] += d·results[m] (+ offset·sums[m])`: one block's products scaled into the totals.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,f16c")]
#[inline]
unsafe fn scale_block(
    acc: &mut [__m512; TILE_ROWS],
    scales: *const u8,
    q4: bool,
    results: *const f32,
    sums: *const f32,
) {
    // SAFETY: `scales` holds the block's `d` (and, 4-bit, offset) of 16 rows, `results` a
    // `[16][16]` f32 tile and `sums` (4-bit) 16 block sums.
    unsafe {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(scales.cast()));
        for (m, total) in acc.iter_mut().enumerate() {
            *total = _mm512_fmadd_ps(d, _mm512_load_ps(results.add(m * PANEL)), *total);
        }
        if q4 {
            let offset = _mm512_cvtph_ps(_mm256_loadu_si256(scales.add(SCALES).cast()));
            for (m, total) in acc.iter_mut().enumerate() {
                *total = _mm512_fmadd_ps(offset, _mm512_set1_ps(*sums.add(m)), *total);
            }
        }
    }
}

/// One tile of activation rows (`rows` of them valid) times `P` panels: per block, the split
/// activations times each panel's `q` on the tiles, then `d` and the offset applied in f32,
/// block `b`'s scaling overlapping block `b + 1`'s products.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_product<const P: usize>(
    kind: Kind,
    sources: [*const u8; AMX_PANELS],
    blocks: usize,
    a: *const u16,
    b_tiles: *const u8,
    results: *mut f32,
    sums: *const f32,
    rows: usize,
    out: Destination,
) {
    // SAFETY (whole body): see the caller; `sources` holds the `P` panels' blocks, `a` `blocks`
    // triples of split tiles, `b_tiles` `blocks` tiles per panel, `results` `2·P` 16×16 f32
    // tiles, `sums` `16 · blocks` (4-bit only) and `out` `rows` rows of `out.columns` values.
    unsafe {
        let (block_bytes, q4) = match kind {
            Kind::Q4 => (Q4_BLOCK, true),
            Kind::Q8 => (Q8_BLOCK, false),
        };
        let result = |block: usize, panel: usize| results.add(((block & 1) * P + panel) * TILE_ROWS * PANEL);
        let products = |block: usize| {
            let a = a.add(block * A_BLOCK);
            let b = std::array::from_fn(|panel| b_tiles.add((panel * blocks + block) * B_TILE_BYTES));
            let results = std::array::from_fn(|panel| result(block, panel));
            if block & 1 == 0 {
                block_products::<P, 0>(a, b, results);
            } else {
                block_products::<P, 1>(a, b, results);
            }
        };
        let mut acc = [[_mm512_setzero_ps(); TILE_ROWS]; P];
        products(0);
        for block in 0..blocks {
            if block + 1 < blocks {
                products(block + 1);
            }
            for (panel, acc) in acc.iter_mut().enumerate() {
                scale_block(
                    acc,
                    sources[panel].add(block * block_bytes),
                    q4,
                    result(block, panel),
                    sums.wrapping_add(block * TILE_ROWS),
                );
            }
        }
        for (panel, acc) in acc.iter().enumerate() {
            let columns = out.columns.saturating_sub(panel * PANEL).min(PANEL);
            let mask = ((1u32 << columns) - 1) as __mmask16;
            for (m, total) in acc.iter().enumerate() {
                if m < rows {
                    _mm512_mask_storeu_ps(out.first.add(m * out.stride + panel * PANEL), mask, *total);
                }
            }
        }
    }
}
