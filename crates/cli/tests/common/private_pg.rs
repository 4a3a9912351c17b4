//! A throwaway PostgreSQL cluster of the test's own (initdb + pg_ctl as user postgres, in a
//! temporary directory, on a free port), never the shared one: for tests that stop it, or
//! configure it (TLS). Stopped and removed on drop, also when the test fails.

use std::path::{Path, PathBuf};
use std::process::Command;

pub const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

pub struct PrivatePg {
    pub dir: PathBuf,
    pub port: u16,
    /// Server settings passed as `-c name=value` at every start.
    settings: Vec<(String, String)>,
}

fn as_postgres(args: &[&str]) -> std::process::Output {
    Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .args(args)
        .output()
        .expect("runuser (the test runs as root; PostgreSQL refuses to run as root)")
}

impl PrivatePg {
    /// initdb, start, and create the database `lastcall`.
    pub fn start() -> Self {
        let pg = Self::init();
        pg.ctl_start();
        pg.create_db();
        pg
    }

    /// A new cluster, not started: [`set`](Self::set) and [`install`](Self::install) what
    /// it needs, then [`ctl_start`](Self::ctl_start) and [`create_db`](Self::create_db).
    pub fn init() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!("lastcall-pg-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        chown_postgres(&dir);
        let pg = Self {
            dir,
            port,
            settings: Vec::new(),
        };
        let out = as_postgres(&[
            &format!("{PG_BIN}/initdb"),
            "-D",
            pg.data().to_str().unwrap(),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
        ]);
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        pg
    }

    /// A server setting for the next starts (`ssl`, `ssl_cert_file`, …).
    pub fn set(&mut self, name: &str, value: &str) {
        self.settings.retain(|(n, _)| n != name);
        self.settings.push((name.to_owned(), value.to_owned()));
    }

    /// Copy `from` into the cluster's directory, owned by postgres with mode 0600 (as the
    /// server requires of its TLS key); returns the new path.
    pub fn install(&self, from: &Path, name: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let to = self.dir.join(name);
        std::fs::copy(from, &to).unwrap();
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o600)).unwrap();
        chown_postgres(&to);
        to
    }

    pub fn create_db(&self) {
        let out = as_postgres(&[
            &format!("{PG_BIN}/createdb"),
            "-h",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-U",
            "postgres",
            "lastcall",
        ]);
        assert!(
            out.status.success(),
            "createdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// `postgres://postgres@127.0.0.1:PORT/lastcall` (trust authentication).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/lastcall", self.port)
    }

    /// Start and wait until it accepts connections (`pg_ctl -w`).
    pub fn ctl_start(&self) {
        let mut opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.display()
        );
        for (n, v) in &self.settings {
            opts.push_str(&format!(" -c {n}={v}"));
        }
        let log = self.dir.join("pg.log");
        let out = as_postgres(&[
            &format!("{PG_BIN}/pg_ctl"),
            "-D",
            self.data().to_str().unwrap(),
            "-o",
            &opts,
            "-l",
            log.to_str().unwrap(),
            "-w",
            "start",
        ]);
        assert!(
            out.status.success(),
            "pg_ctl start: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    pub fn stop_immediate(&self) {
        let _ = as_postgres(&[
            &format!("{PG_BIN}/pg_ctl"),
            "-D",
            self.data().to_str().unwrap(),
            "-m",
            "immediate",
            "-w",
            "stop",
        ]);
    }

    /// The postmaster's pid (the first line of `postmaster.pid`) while it runs.
    pub fn postmaster_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.data().join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    pub fn is_up(&self) -> bool {
        Command::new(format!("{PG_BIN}/pg_isready"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"])
            .current_dir(&self.dir)
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        self.stop_immediate();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn chown_postgres(path: &Path) {
    Command::new("chown")
        .args(["postgres:postgres", path.to_str().unwrap()])
        .status()
        .unwrap();
}
