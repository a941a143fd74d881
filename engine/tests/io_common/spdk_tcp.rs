//! An NVMe/TCP target on loopback for the SPDK backend's NVMe driver: SPDK's `nvmf_tgt`
//! (PREFIX/bin, the SPDK the engine was built against) serving aio bdevs over files, one
//! subsystem per device, configured over its JSON-RPC socket. Started once per test process
//! from a thread that lives as long as the process; a shell started with `setpriv --pdeathsig
//! TERM` ends the target with the process and removes its folder (RPC socket, log, DPDK's
//! runtime folder: a static's `TempDir` is never dropped), so nothing outlives the tests.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use teraio_engine::array::Target;

struct Tgt {
    sock: PathBuf,
    port: u16,
    _dir: tempfile::TempDir,
}

static TGT: OnceLock<Tgt> = OnceLock::new();

/// `sh -c REAPER sh DIR NVMF_TGT ARGS...`, run with `setpriv --pdeathsig TERM`: starts the
/// target (killed with the shell should the shell itself be killed) and, on SIGTERM (this
/// process ended), kills it and removes DIR. A target that dies by itself keeps DIR (its log).
const REAPER: &str = r#"dir=$1; shift
trap 'kill -KILL $tgt 2>/dev/null; wait $tgt; rm -rf "$dir"; exit 0' TERM
setpriv --pdeathsig KILL "$@" &
tgt=$!
wait $tgt"#;
static SEQ: AtomicUsize = AtomicUsize::new(0);

/// One JSON-RPC call to the target; panics with SPDK's message on an error.
pub fn rpc(method: &str, params: Value) -> Value {
    let t = tgt();
    rpc_at(&t.sock, method, params).unwrap_or_else(|e| panic!("nvmf_tgt {method}: {e}"))
}

fn rpc_at(sock: &Path, method: &str, params: Value) -> Result<Value, String> {
    let mut s = UnixStream::connect(sock).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let req = json!({"jsonrpc": "2.0", "method": method, "params": params, "id": 1});
    s.write_all(req.to_string().as_bytes()).map_err(|e| e.to_string())?;
    let resp: Value = serde_json::Deserializer::from_reader(&s)
        .into_iter::<Value>()
        .next()
        .ok_or("no answer")?
        .map_err(|e| e.to_string())?;
    match resp.get("error") {
        Some(e) => Err(e.to_string()),
        None => Ok(resp["result"].clone()),
    }
}

fn tgt() -> &'static Tgt {
    TGT.get_or_init(|| {
        let libdir = PathBuf::from(env!("TERAIO_SPDK_LIBDIR"));
        let bin = libdir.join("../bin/nvmf_tgt");
        assert!(
            bin.exists(),
            "{} is missing: build SPDK with scripts/build-spdk.sh",
            bin.display()
        );
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("nvmf.sock");
        let log = std::fs::File::create(dir.path().join("nvmf_tgt.log")).unwrap();
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut cmd = Command::new("setpriv");
        cmd.args(["--pdeathsig", "TERM", "sh", "-c", REAPER, "sh"])
            .arg(dir.path())
            .arg(&bin)
            .args(["--no-pci", "--no-huge", "-s", "1024", "-m", "0x1"])
            .args(["--disable-cpumask-locks", "--num-trace-entries", "0", "--interrupt-mode"])
            .arg("-r")
            .arg(&sock)
            .env("LD_LIBRARY_PATH", &libdir)
            .env("RUNTIME_DIRECTORY", dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        let (tx, rx) = std::sync::mpsc::channel();
        // The thread waits on the shell for the rest of the process: the shell's death signal
        // is tied to the thread that started it.
        std::thread::spawn(move || {
            let mut child = cmd.spawn().expect("starting nvmf_tgt through setpriv and sh");
            tx.send(()).unwrap();
            let _ = child.wait();
        });
        rx.recv().unwrap();
        let start = Instant::now();
        while rpc_at(&sock, "spdk_get_version", Value::Null).is_err() {
            assert!(start.elapsed() < Duration::from_secs(30), "nvmf_tgt did not start in 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        rpc_at(&sock, "nvmf_create_transport", json!({"trtype": "TCP", "max_io_size": 1 << 20}))
            .expect("TCP transport");
        Tgt { sock, port, _dir: dir }
    })
}

/// Subsystems served for one array; deleted (with their bdevs) when dropped.
pub struct Served {
    nqns: Vec<String>,
    bdevs: Vec<String>,
    port: u16,
}

impl Served {
    /// The array targets, in order.
    pub fn targets(&self) -> Vec<Target> {
        self.nqns.iter().map(|n| Target::Path(self.target(n).into())).collect()
    }

    fn target(&self, nqn: &str) -> String {
        format!("nvme:trtype:tcp adrfam:ipv4 traddr:127.0.0.1 trsvcid:{} subnqn:{nqn}", self.port)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        for n in &self.nqns {
            rpc("nvmf_delete_subsystem", json!({"nqn": n}));
        }
        for b in &self.bdevs {
            rpc("bdev_aio_delete", json!({"name": b}));
        }
    }
}

/// Serve `devices` namespaces of `capacity` bytes each, backed by files in `dir`.
pub fn serve(dir: &Path, devices: usize, capacity: u64) -> Served {
    let t = tgt();
    let mut served = Served { nqns: Vec::new(), bdevs: Vec::new(), port: t.port };
    for _ in 0..devices {
        let k = SEQ.fetch_add(1, Ordering::Relaxed);
        let file = dir.join(format!("tcp{k}"));
        std::fs::File::create(&file).unwrap().set_len(capacity).unwrap();
        let bdev = format!("tcp{k}");
        rpc("bdev_aio_create", json!({"name": bdev, "filename": file, "block_size": 4096}));
        served.bdevs.push(bdev.clone());
        let nqn = format!("nqn.2016-06.io.teraio:tcp{k}");
        rpc(
            "nvmf_create_subsystem",
            json!({"nqn": nqn, "allow_any_host": true, "serial_number": format!("TERAIO{k:08}")}),
        );
        served.nqns.push(nqn.clone());
        rpc("nvmf_subsystem_add_ns", json!({"nqn": nqn, "namespace": {"bdev_name": bdev}}));
        rpc(
            "nvmf_subsystem_add_listener",
            json!({"nqn": nqn, "listen_address": {"trtype": "tcp", "adrfam": "ipv4",
                "traddr": "127.0.0.1", "trsvcid": t.port.to_string()}}),
        );
    }
    served
}
