//! A throwaway RabbitMQ node of the test's own, never the shared one (127.0.0.1:5672): its
//! own node name, ports, data and log directories, config file, Erlang cookie (`HOME`) and
//! no plugins, all in a temporary directory. Ready when `rabbitmqctl await_startup` says so;
//! stopped and removed on drop, also when the test fails. For fault drills a node can be
//! killed (`kill -9` of its VM) and started again on the same ports and data
//! ([`kill9`](PrivateRabbit::kill9), [`start_again`](PrivateRabbit::start_again)), and
//! [`cluster`](PrivateRabbit::cluster) joins several such nodes into one cluster on this host.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const RABBIT_BIN: &str = "/usr/lib/rabbitmq/bin";

pub struct PrivateRabbit {
    pub dir: PathBuf,
    pub node: String,
    /// The port of the node's one AMQP listener (TLS for [`start_tls`](Self::start_tls)).
    pub port: u16,
    /// The management API's port, for a node made by
    /// [`start_with_management`](Self::start_with_management).
    pub management_port: Option<u16>,
    /// The Erlang distribution and node ports, kept for [`start_again`](Self::start_again).
    dist_port: u16,
    node_port: u16,
    child: Option<Child>,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl PrivateRabbit {
    /// A node whose only AMQP listener is TLS on 127.0.0.1 (`amqps://…:port`), with this
    /// server certificate; it asks for a client certificate (verified against `ca`) but does
    /// not require one.
    pub fn start_tls(ca: &Path, cert: &Path, key: &Path) -> Self {
        Self::start(|port| {
            format!(
                "listeners.tcp = none\n\
                 listeners.ssl.default = 127.0.0.1:{port}\n\
                 ssl_options.cacertfile = {}\n\
                 ssl_options.certfile = {}\n\
                 ssl_options.keyfile = {}\n\
                 ssl_options.verify = verify_peer\n\
                 ssl_options.fail_if_no_peer_cert = false\n",
                ca.display(),
                cert.display(),
                key.display()
            )
        })
    }

    /// A node with the `rabbitmq.conf` that `conf(port)` returns (its listeners on `port`).
    pub fn start(conf: impl FnOnce(u16) -> String) -> Self {
        let mut me = Self::prepare(conf, None);
        me.spawn();
        me.wait_ready(Duration::from_secs(120));
        me
    }

    /// A node listening on `127.0.0.1:port` for AMQP with the management plugin enabled
    /// on a port of its own (`http://127.0.0.1:{management_port}`, guest/guest).
    pub fn start_with_management() -> Self {
        let management_port = free_port();
        let mut me = Self::prepare(
            |port| {
                format!(
                    "listeners.tcp.default = 127.0.0.1:{port}\n\
                     management.tcp.ip = 127.0.0.1\n\
                     management.tcp.port = {management_port}\n"
                )
            },
            None,
        );
        std::fs::write(me.dir.join("enabled_plugins"), "[rabbitmq_management].\n").unwrap();
        me.management_port = Some(management_port);
        me.spawn();
        me.wait_ready(Duration::from_secs(120));
        me
    }

    /// `http://127.0.0.1:{management_port}` of a node with the management plugin.
    pub fn management_url(&self) -> String {
        format!(
            "http://127.0.0.1:{}",
            self.management_port
                .expect("a node started with management")
        )
    }

    /// The node's directory, config and (when given) Erlang cookie, not started yet.
    fn prepare(conf: impl FnOnce(u16) -> String, cookie: Option<&str>) -> Self {
        let port = free_port();
        let node = format!("lastcall-test-{}-{port}@localhost", std::process::id());
        let dir =
            std::env::temp_dir().join(format!("lastcall-rabbit-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let me = Self {
            dir,
            node,
            port,
            management_port: None,
            dist_port: free_port(),
            node_port: free_port(),
            child: None,
        };
        std::fs::write(me.dir.join("rabbitmq.conf"), conf(port)).unwrap();
        std::fs::write(me.dir.join("enabled_plugins"), "[].\n").unwrap();
        // Not /etc/rabbitmq/rabbitmq-env.conf, which names the shared node.
        std::fs::write(me.dir.join("rabbitmq-env.conf"), "").unwrap();
        if let Some(cookie) = cookie {
            use std::os::unix::fs::PermissionsExt;
            let path = me.dir.join(".erlang.cookie");
            std::fs::write(&path, cookie).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
        }
        me
    }

    /// Start `rabbitmq-server` for this node (its data directory is kept between starts).
    fn spawn(&mut self) {
        let conf_file = self.dir.join("rabbitmq.conf");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.out"))
            .unwrap();
        let child = self
            .env(&mut Command::new(format!("{RABBIT_BIN}/rabbitmq-server")))
            .env("RABBITMQ_NODE_PORT", self.node_port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}",
            )
            .env("RABBITMQ_MNESIA_BASE", self.dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", self.dir.join("log"))
            .env("RABBITMQ_CONFIG_FILE", &conf_file)
            .env(
                "RABBITMQ_ADVANCED_CONFIG_FILE",
                self.dir.join("advanced.config"),
            )
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                self.dir.join("enabled_plugins"),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("rabbitmq-server (RabbitMQ must be installed)");
        self.child = Some(child);
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f`, with `query` (e.g. `?heartbeat=2`) appended.
    pub fn url(&self, query: &str) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f{query}", self.port)
    }

    /// The node's VM pid (from its pid file), if it is this node's VM and alive.
    pub fn vm_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.dir.join("pid"))
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok())
            // Still this node's VM, not a reused pid: its command line names the node's
            // home (`-home DIR`), not the node name.
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(self.dir.to_str().unwrap()))
            })
    }

    /// `kill -9` the node's Erlang VM (a crashed node: no clean shutdown, nothing flushed
    /// on purpose) and wait until the process is gone. [`start_again`](Self::start_again)
    /// brings it back.
    pub fn kill9(&mut self) {
        let pid = self.vm_pid().expect("the node's VM is running");
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let until = Instant::now() + Duration::from_secs(30);
        while std::path::Path::new(&format!("/proc/{pid}")).exists() {
            assert!(
                Instant::now() < until,
                "the node's VM {pid} outlived kill -9"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Start the node again on the same ports, data and name (after [`kill9`](Self::kill9)),
    /// and wait until it is ready.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "the node is still running");
        self.spawn();
        self.wait_ready(Duration::from_secs(120));
    }

    /// A clean restart of the node: `rabbitmqctl stop` (returns once the VM is gone), then
    /// started again on the same ports, data and name, and waited for until ready.
    pub fn restart(&mut self) {
        let pid_file = self.dir.join("pid");
        let out = self.ctl(&["stop", pid_file.to_str().unwrap()]);
        assert!(
            out.status.success(),
            "rabbitmqctl stop: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
        self.start_again();
    }

    /// `n` nodes on this host joined into one cluster (the first is the seed): each with
    /// its own name, ports and directory, all with one Erlang cookie. Dropping them stops
    /// every node.
    pub fn cluster(n: usize) -> Vec<Self> {
        let cookie = format!("LASTCALLCHAOS{}{}", std::process::id(), free_port());
        let mut nodes: Vec<Self> = (0..n)
            .map(|_| {
                Self::prepare(
                    |port| format!("listeners.tcp.default = 127.0.0.1:{port}\n"),
                    Some(&cookie),
                )
            })
            .collect();
        for node in &mut nodes {
            node.spawn();
        }
        for node in &mut nodes {
            node.wait_ready(Duration::from_secs(180));
        }
        let seed = nodes[0].node.clone();
        for node in &nodes[1..] {
            for args in [
                vec!["stop_app"],
                vec!["join_cluster", seed.as_str()],
                vec!["start_app"],
            ] {
                let out = node.ctl(&args);
                assert!(
                    out.status.success(),
                    "{} {args:?}: {}{}",
                    node.node,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        for node in &mut nodes {
            node.wait_ready(Duration::from_secs(120));
        }
        nodes
    }

    /// `HOME` (the Erlang cookie), node name, env file and pid file: what the server and
    /// `rabbitmqctl` must agree on.
    fn env<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        cmd.env("HOME", &self.dir)
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_CONF_ENV_FILE", self.dir.join("rabbitmq-env.conf"))
            .env("RABBITMQ_PID_FILE", self.dir.join("pid"))
    }

    /// `rabbitmqctl -n NODE args…`.
    pub fn ctl(&self, args: &[&str]) -> std::process::Output {
        self.env(&mut Command::new(format!("{RABBIT_BIN}/rabbitmqctl")))
            .args(["-n", &self.node])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("rabbitmqctl")
    }

    fn wait_ready(&mut self, within: Duration) {
        let until = Instant::now() + within;
        // First the listener (cheap to poll), then the node's own word.
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "rabbitmq-server exited ({status}) before it was ready:\n{}",
                    self.server_output()
                );
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                break;
            }
            assert!(
                Instant::now() < until,
                "RabbitMQ node {} did not open port {}:\n{}",
                self.node,
                self.port,
                self.server_output()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        loop {
            let out = self.ctl(&["await_startup", "--timeout", "10"]);
            if out.status.success() {
                return;
            }
            assert!(
                Instant::now() < until,
                "RabbitMQ node {} not ready: {}\n{}",
                self.node,
                String::from_utf8_lossy(&out.stderr),
                self.server_output()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn server_output(&self) -> String {
        let tail = |p: PathBuf| {
            let s = std::fs::read_to_string(p).unwrap_or_default();
            let start = s.len().saturating_sub(4_000);
            s[s.ceil_char_boundary(start)..].to_owned()
        };
        format!(
            "{}\n{}",
            tail(self.dir.join("server.out")),
            tail(self.dir.join("log").join(format!("{}.log", self.node)))
        )
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        // `stop PIDFILE` returns once the node's process is gone.
        let pid_file = self.dir.join("pid");
        if self.child.is_some() {
            let _ = self.ctl(&["stop", pid_file.to_str().unwrap()]);
        }
        if let Some(pid) = self.vm_pid() {
            // stop failed
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::env::var_os("LASTCALL_KEEP_RABBIT_DIRS").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
