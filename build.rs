//! Without the `cuda` feature this does nothing. With it, every kernels/*.cu
//! is compiled to PTX once per target architecture (bindgen_cuda for sm_75 and
//! sm_80, nvcc directly for sm_90a), and
//! `ptx.rs` in OUT_DIR exposes them as `<KERNEL>_SM<arch>` string constants,
//! with the sm_80 and sm_90a ones also assembled (ptxas) into SASS,
//! `<KERNEL>_SM<arch>_CUBIN` bytes.
//! The crate picks the newest module the device can run at run time.
//! `tiles.rs` in OUT_DIR is kernels/tiles.def (the forward's tile
//! configurations, which the kernels instantiate) as a Rust table.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        #[cfg(feature = "cuda")]
        cuda::build();
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::fmt::Write;
    use std::path::PathBuf;

    /// sm_75: Turing and later (SIMT paths only); sm_80: Ampere and later (mma.sync).
    const ARCHS: [usize; 2] = [75, 80];

    pub fn build() {
        println!("cargo:rerun-if-changed=kernels");
        let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
        let kernels: Vec<PathBuf> = std::fs::read_dir("kernels")
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "cu"))
            .collect();
        let mut rs = String::new();
        for arch in ARCHS {
            let dir = out.join(format!("sm{arch}"));
            // bindgen_cuda only compares a .ptx with its .cu: drop stale PTX so header edits rebuild too.
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            bindgen_cuda::Builder::default()
                .kernel_paths(kernels.clone())
                .include_paths_glob("kernels/*.cuh")
                .out_dir(&dir)
                .compute_cap(arch)
                .arg("-O3")
                .arg("--std=c++17")
                .build_ptx()
                .expect("nvcc failed on kernels/");
            for k in &kernels {
                let stem = k.file_stem().unwrap().to_str().unwrap();
                let path = dir.join(format!("{stem}.ptx"));
                writeln!(
                    rs,
                    "pub const {}_SM{arch}: &str = include_str!({:?});",
                    stem.to_uppercase(),
                    path.display().to_string()
                )
                .unwrap();
            }
        }
        // sm_90a (Hopper wgmma): nvcc directly, with -gencode (an -arch=sm_90a
        // shorthand also runs a plain sm_90 pass that rejects wgmma). PTX for
        // sm_90a loads only on compute capability 9.0 devices.
        let dir = out.join("sm90a");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
        for k in &kernels {
            let stem = k.file_stem().unwrap().to_str().unwrap();
            let path = dir.join(format!("{stem}.ptx"));
            let status = std::process::Command::new(&nvcc)
                .args(["--ptx", "-gencode=arch=compute_90a,code=compute_90a", "-O3", "--std=c++17", "-Ikernels"])
                .arg("-o")
                .arg(&path)
                .arg(k)
                .status()
                .expect("nvcc not found (set NVCC or PATH)");
            assert!(status.success(), "nvcc failed on {} for sm_90a", k.display());
            writeln!(
                rs,
                "pub const {}_SM90A: &str = include_str!({:?});",
                stem.to_uppercase(),
                path.display().to_string()
            )
            .unwrap();
        }
        // SASS of the sm_80 and sm_90a PTX (`<KERNEL>_SM80_CUBIN`, `_SM90A_CUBIN`):
        // a device of that family loads it without the driver's JIT, which
        // takes about 50 s on first use for all modules (the driver caches
        // it per machine, so every fresh machine paid it once).
        let ptxas = std::path::Path::new(&nvcc).with_file_name("ptxas");
        let ptxas = if ptxas.exists() { ptxas } else { PathBuf::from("ptxas") };
        let mut jobs: Vec<(PathBuf, &str)> = Vec::new();
        for arch in ["sm80", "sm90a"] {
            jobs.extend(kernels.iter().map(|k| (out.join(arch).join(k.file_stem().unwrap()), arch)));
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(jobs.len());
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    while let Some((stem, arch)) = jobs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                        let sm = if *arch == "sm80" { "sm_80" } else { "sm_90a" };
                        let out = std::process::Command::new(&ptxas)
                            .args(["-O3", "-arch", sm])
                            .arg(stem.with_extension("ptx"))
                            .arg("-o")
                            .arg(stem.with_extension("cubin"))
                            .output()
                            .expect("ptxas not found (next to NVCC, or on PATH)");
                        let log = String::from_utf8_lossy(&out.stderr);
                        assert!(out.status.success(), "ptxas failed on {}.ptx for {sm}:\n{log}", stem.display());
                        // A kernel whose wgmma ptxas serializes (a wait after
                        // each one, for want of registers) runs at a fraction
                        // of its speed and says so only here.
                        let serialized: Vec<&str> = log.lines().filter(|l| l.contains("(C7512)")).collect();
                        assert!(serialized.is_empty(), "{}.ptx for {sm}:\n{}", stem.display(), serialized.join("\n"));
                    }
                });
            }
        });
        for (stem, arch) in &jobs {
            writeln!(
                rs,
                "pub const {}_{}_CUBIN: &[u8] = include_bytes!({:?});",
                stem.file_stem().unwrap().to_str().unwrap().to_uppercase(),
                arch.to_uppercase(),
                stem.with_extension("cubin").display().to_string()
            )
            .unwrap();
        }
        std::fs::write(out.join("ptx.rs"), rs).unwrap();
        std::fs::write(out.join("tiles.rs"), tiles_table()).unwrap();
    }

    /// `pub const TILES: &[TileRow]` from the MAXSIM_TILE rows of
    /// kernels/tiles.def, and `pub const HIDDEN: HiddenTile` from its
    /// HIDDEN_TILE row.
    fn tiles_table() -> String {
        let def = std::fs::read_to_string("kernels/tiles.def").expect("kernels/tiles.def");
        let mut rs = String::from("pub const TILES: &[TileRow] = &[\n");
        for (i, line) in def.lines().enumerate() {
            let Some(rest) = line.trim().strip_prefix("MAXSIM_TILE(") else { continue };
            let args = rest.split(')').next().unwrap_or("");
            let f: Vec<&str> = args.split(',').map(str::trim).collect();
            let num = |k: usize| -> usize {
                f.get(k).and_then(|x| x.parse().ok()).unwrap_or_else(|| {
                    panic!("kernels/tiles.def:{}: field {k} of MAXSIM_TILE is not a number: {line}", i + 1)
                })
            };
            assert!(f.len() == 8, "kernels/tiles.def:{}: MAXSIM_TILE takes 8 fields: {line}", i + 1);
            writeln!(
                rs,
                "    TileRow {{ name: {:?}, family: {:?}, wm: {}, wn: {}, mt: {}, nt: {}, stages: {}, res_stages: {} }},",
                f[0],
                f[1],
                num(2),
                num(3),
                num(4),
                num(5),
                num(6),
                num(7)
            )
            .unwrap();
        }
        rs.push_str("];\n");
        let hidden: Vec<&str> = def.lines().filter(|l| l.trim().starts_with("HIDDEN_TILE(")).collect();
        assert!(hidden.len() == 1, "kernels/tiles.def: expected one HIDDEN_TILE row");
        let args = hidden[0].trim()["HIDDEN_TILE(".len()..].split(')').next().unwrap_or("");
        let f: Vec<usize> = args
            .split(',')
            .map(|x| x.trim().parse().unwrap_or_else(|_| panic!("kernels/tiles.def: HIDDEN_TILE field {x:?}")))
            .collect();
        assert!(f.len() == 5, "kernels/tiles.def: HIDDEN_TILE takes 5 fields: {}", hidden[0]);
        writeln!(
            rs,
            "pub const HIDDEN: HiddenTile = HiddenTile {{ bd: {}, bq: {}, ks: {}, stages: {}, threads: {} }};",
            f[0], f[1], f[2], f[3], f[4]
        )
        .unwrap();
        rs
    }
}
