//! `.npy` files: the header parsed by hand so that a file's data can be
//! memory-mapped and handed to a device without a copy in RAM first, and
//! writing through candle (numpy format 1.0, as numpy and fast-plaid read).

use crate::store::io_err;
use candle_core::{bail, DType, Device, Error, Result, Tensor};
use memmap2::Mmap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// A memory-mapped `.npy` file: its dtype, shape, and the mapped data.
pub(crate) struct MappedNpy {
    pub path: PathBuf,
    pub dtype: DType,
    pub shape: Vec<usize>,
    map: Mmap,
    offset: usize,
}

fn err(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Msg(format!("dir: {}: {what}", path.display()))
}

impl MappedNpy {
    /// Maps `path` and parses its header (little-endian, C order, the dtypes
    /// an index holds); the data must be as long as the shape says.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| err(path, format!("cannot open: {e}")))?;
        // SAFETY: read-only mapping; an index's files are not modified while
        // it is open (updates write new files and rename them into place).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| err(path, format!("cannot map: {e}")))?;
        if map.len() < 10 || &map[..6] != b"\x93NUMPY" {
            return Err(err(path, "not an .npy file (bad magic)"));
        }
        let (hlen, start) = match map[6] {
            1 => (u16::from_le_bytes([map[8], map[9]]) as usize, 10),
            2 | 3 if map.len() >= 12 => (u32::from_le_bytes([map[8], map[9], map[10], map[11]]) as usize, 12),
            v => return Err(err(path, format!("unsupported .npy version {v}"))),
        };
        let header = map.get(start..start + hlen).ok_or_else(|| err(path, "truncated header"))?;
        let header = std::str::from_utf8(header).map_err(|_| err(path, "header is not text"))?;
        let field = |key: &str| -> Result<&str> {
            let at = header.find(&format!("'{key}'")).ok_or_else(|| err(path, format!("header has no '{key}'")))?;
            let rest = header[at + key.len() + 2..].trim_start();
            Ok(rest.strip_prefix(':').ok_or_else(|| err(path, format!("bad '{key}' entry")))?.trim_start())
        };
        let descr = field("descr")?;
        let descr = descr.split(['\'', '"']).nth(1).ok_or_else(|| err(path, "bad 'descr'"))?;
        let dtype = match descr {
            "<f2" => DType::F16,
            "<f4" => DType::F32,
            "<f8" => DType::F64,
            "<i8" => DType::I64,
            "<i4" => DType::I32,
            "<u4" => DType::U32,
            "|u1" | "<u1" => DType::U8,
            d => return Err(err(path, format!("unsupported dtype {d}"))),
        };
        if field("fortran_order")?.starts_with("True") {
            return Err(err(path, "Fortran order is not supported"));
        }
        let shape = field("shape")?;
        let shape =
            shape.strip_prefix('(').and_then(|s| s.split(')').next()).ok_or_else(|| err(path, "bad 'shape'"))?;
        let shape: Vec<usize> = shape
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.trim_end_matches('L').parse::<usize>().map_err(|_| err(path, format!("bad dimension {s:?}"))))
            .collect::<Result<_>>()?;
        let offset = start + hlen;
        let want = shape.iter().product::<usize>() * dtype.size_in_bytes();
        if map.len() < offset + want {
            return Err(err(
                path,
                format!("truncated: {} data bytes for shape {shape:?}, {want} expected", map.len() - offset),
            ));
        }
        Ok(Self { path: path.to_path_buf(), dtype, shape, map, offset })
    }

    /// The bytes of rows `a..b` of the first axis.
    pub fn row_bytes(&self, a: usize, b: usize) -> Result<&[u8]> {
        let rows = self.shape.first().copied().unwrap_or(1);
        if a > b || b > rows {
            return Err(err(&self.path, format!("rows {a}..{b} of {rows}")));
        }
        let row: usize = self.shape.iter().skip(1).product::<usize>() * self.dtype.size_in_bytes();
        Ok(&self.map[self.offset + a * row..self.offset + b * row])
    }

    /// Rows `a..b` of the first axis as a tensor on `device` (CUDA: copied
    /// from the mapping to the device, no intermediate buffer).
    pub fn rows(&self, a: usize, b: usize, device: &Device) -> Result<Tensor> {
        let rows = self.shape.first().copied().unwrap_or(1);
        if a > b || b > rows {
            return Err(err(&self.path, format!("rows {a}..{b} of {rows}")));
        }
        let mut shape = self.shape.clone();
        if shape.is_empty() {
            shape.push(1);
        }
        shape[0] = b - a;
        if a == b {
            return empty(&shape, self.dtype, device);
        }
        Tensor::from_raw_buffer(self.row_bytes(a, b)?, self.dtype, &shape, device)
    }

    /// Rows `a..b` as tensors on `device`, `piece` rows each (the last
    /// shorter), read through one buffer with file reads, not the mapping:
    /// the host holds one piece, where reading the mapping would keep every
    /// page of the array resident until the mapping is dropped (on a GPU the
    /// pages are only on their way to the device).
    pub fn row_pieces(&self, a: usize, b: usize, piece: usize, device: &Device) -> Result<Vec<Tensor>> {
        use std::io::{Read, Seek, SeekFrom};
        let rows = self.shape.first().copied().unwrap_or(1);
        if a > b || b > rows || piece == 0 {
            return Err(err(&self.path, format!("rows {a}..{b} of {rows} in pieces of {piece}")));
        }
        let row: usize = self.shape.iter().skip(1).product::<usize>() * self.dtype.size_in_bytes();
        let mut f = File::open(&self.path).map_err(|e| err(&self.path, format!("cannot open: {e}")))?;
        f.seek(SeekFrom::Start((self.offset + a * row) as u64)).map_err(|e| err(&self.path, format!("seek: {e}")))?;
        let mut buf = vec![0u8; piece.min(b - a) * row];
        let mut out = Vec::with_capacity((b - a).div_ceil(piece));
        for lo in (a..b).step_by(piece) {
            let n = piece.min(b - lo);
            let bytes = &mut buf[..n * row];
            f.read_exact(bytes).map_err(|e| err(&self.path, format!("read: {e}")))?;
            let mut shape = self.shape.clone();
            shape[0] = n;
            out.push(Tensor::from_raw_buffer(bytes, self.dtype, &shape, device)?);
        }
        Ok(out)
    }

    /// The whole array on `device`.
    pub fn tensor(&self, device: &Device) -> Result<Tensor> {
        if self.shape.is_empty() {
            return Tensor::from_raw_buffer(
                &self.map[self.offset..self.offset + self.dtype.size_in_bytes()],
                self.dtype,
                &[],
                device,
            );
        }
        self.rows(0, self.shape[0], device)
    }
}

/// A `[0, ..]` tensor on `device` (a zero-size view: CUDA allocates no empty buffer).
pub(crate) fn empty(dims: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    let mut one = dims.to_vec();
    one[0] = 1;
    Tensor::zeros(one, dtype, device)?.narrow(0, 0, 0)
}

/// Reads a small `.npy` file into a tensor on `device`.
pub(crate) fn read(path: &Path, device: &Device) -> Result<Tensor> {
    MappedNpy::open(path)?.tensor(device)
}

/// The elements of a tensor copied to the host, kept in their own type (a
/// `Vec<T>` must be freed with `T`'s alignment), viewed as bytes.
pub(crate) enum HostData {
    U8(Vec<u8>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    F16(Vec<half::f16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl HostData {
    /// The elements' bytes in the machine's order (little-endian where
    /// `.npy` files are written).
    pub fn as_bytes(&self) -> &[u8] {
        fn bytes<T: Copy>(v: &[T]) -> &[u8] {
            // SAFETY: plain numbers without padding, viewed as the bytes they occupy (u8 needs no alignment).
            unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
        }
        match self {
            HostData::U8(v) => v,
            HostData::U32(v) => bytes(v),
            HostData::I32(v) => bytes(v),
            HostData::I64(v) => bytes(v),
            HostData::F16(v) => bytes(v),
            HostData::F32(v) => bytes(v),
            HostData::F64(v) => bytes(v),
        }
    }
}

/// `t`'s elements copied to the host (straight from a device: one copy).
pub(crate) fn raw_bytes(t: &Tensor) -> Result<HostData> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::U8 => HostData::U8(t.to_vec1()?),
        DType::U32 => HostData::U32(t.to_vec1()?),
        DType::I32 => HostData::I32(t.to_vec1()?),
        DType::I64 => HostData::I64(t.to_vec1()?),
        DType::F16 => HostData::F16(t.to_vec1()?),
        DType::F32 => HostData::F32(t.to_vec1()?),
        DType::F64 => HostData::F64(t.to_vec1()?),
        dt => bail!("npy: cannot write {dt:?}"),
    })
}

/// The numpy 1.0 prologue of an array of `descr` (e.g. `<i8`) and `dims`,
/// padded to a multiple of 64 bytes as numpy pads it.
fn header(descr: &str, dims: &[usize]) -> Vec<u8> {
    header_of_length(descr, dims, 0)
}

/// [`header`] padded to at least `min_len` bytes (still a multiple of 64):
/// a file whose first dimension grows keeps its header's length, so that
/// the header can be written again in place.
pub(crate) fn header_of_length(descr: &str, dims: &[usize], min_len: usize) -> Vec<u8> {
    let shape = match dims {
        [] => "()".to_string(),
        [n] => format!("({n},)"),
        d => format!("({})", d.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat(total.max(min_len).div_ceil(64) * 64 - total));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out
}

/// Writes `t` to `path` (numpy format 1.0), with one write of its bytes.
pub(crate) fn write(path: &Path, t: &Tensor) -> Result<()> {
    if !cfg!(target_endian = "little") {
        bail!("npy: writing needs a little-endian machine")
    }
    let descr = match t.dtype() {
        DType::U8 => "|u1",
        DType::U32 => "<u4",
        DType::I32 => "<i4",
        DType::I64 => "<i8",
        DType::F16 => "<f2",
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        dt => bail!("npy: cannot write {dt:?}"),
    };
    let out = header(descr, t.dims());
    // Straight from the device into the bytes written (one copy, not two).
    let data = raw_bytes(t)?;
    let io = |e| io_err(path, "write", e);
    use std::io::Write;
    let mut f = File::create(path).map_err(io)?;
    f.write_all(&out).map_err(io)?;
    f.write_all(data.as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)
}

/// Writes a one-dimensional I64 array of `n` values to `path`, the values
/// handed to `fill` one at a time (never all in memory); `Err` unless it
/// hands exactly `n`.
pub(crate) fn write_i64_stream(
    path: &Path,
    n: usize,
    fill: impl FnOnce(&mut dyn FnMut(i64) -> Result<()>) -> Result<()>,
) -> Result<()> {
    use std::io::Write;
    let io = |e| io_err(path, "write", e);
    let f = File::create(path).map_err(io)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    w.write_all(&header("<i8", &[n])).map_err(io)?;
    let mut count = 0usize;
    fill(&mut |v| {
        count += 1;
        w.write_all(&v.to_le_bytes()).map_err(io)
    })?;
    if count != n {
        bail!("npy: {} was to hold {n} values, {count} were written", path.display())
    }
    let f = w.into_inner().map_err(|e| io(e.into_error()))?;
    f.sync_all().map_err(io)
}

/// `Err` unless `t` has `dtype` and, where given, `shape`.
pub(crate) fn expect(path: &Path, t: &MappedNpy, dtypes: &[DType], rank: usize) -> Result<()> {
    if !dtypes.contains(&t.dtype) || t.shape.len() != rank {
        bail!("dir: {} must be a rank-{rank} array of {dtypes:?}, got {:?} {:?}", path.display(), t.dtype, t.shape)
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Read in pieces through the buffer, or streamed in, the same array as
    /// through the mapping; a range past the end is an error naming the file.
    #[test]
    fn pieces_and_streams_equal_whole_arrays() -> Result<()> {
        let dir = candle_maxsim_testing::tmpdir("npy-pieces");
        let path = dir.join("x.npy");
        let x = Tensor::randn(0f32, 1., (37, 5), &Device::Cpu)?;
        write(&path, &x)?;
        let m = MappedNpy::open(&path)?;
        let whole: Vec<Vec<f32>> = m.tensor(&Device::Cpu)?.to_vec2()?;
        for (a, b, piece) in [(0, 37, 1), (0, 37, 8), (3, 30, 100), (5, 5, 4)] {
            let parts = m.row_pieces(a, b, piece, &Device::Cpu)?;
            assert_eq!(parts.len(), (b - a).div_ceil(piece));
            let got: Vec<Vec<f32>> = parts.iter().map(|t| t.to_vec2::<f32>()).collect::<Result<Vec<_>>>()?.concat();
            assert_eq!(got, whole[a..b].to_vec(), "rows {a}..{b} in pieces of {piece}");
        }
        assert!(m.row_pieces(0, 38, 4, &Device::Cpu).unwrap_err().to_string().contains("x.npy"));
        let ids: Vec<i64> = (0..1000).map(|i| i * 7 - 300).collect();
        let s = dir.join("s.npy");
        write_i64_stream(&s, ids.len(), |out| ids.iter().try_for_each(|&v| out(v)))?;
        let t = dir.join("t.npy");
        write(&t, &Tensor::new(ids.as_slice(), &Device::Cpu)?)?;
        assert_eq!(std::fs::read(&s).unwrap(), std::fs::read(&t).unwrap());
        assert!(write_i64_stream(&s, 3, |out| out(1)).is_err(), "fewer values than announced");
        std::fs::remove_dir_all(&dir).unwrap();
        Ok(())
    }
}
