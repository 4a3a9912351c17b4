//! A throwaway RabbitMQ node of the test's own, never the shared one (127.0.0.1:5672): its
//! own node name, ports, data and log directories, config file, Erlang cookie (`HOME`) and
//! no plugins, all in a temporary directory. Ready when `rabbitmqctl await_startup` says so;
//! stopped and removed on drop, also when the test fails.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const RABBIT_BIN: &str = "/usr/lib/rabbitmq/bin";

pub struct PrivateRabbit {
    pub dir: PathBuf,
    pub node: String,
    /// The port of the node's one AMQP listener (TLS for [`start_tls`](Self::start_tls)).
    pub port: u16,
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
        let port = free_port();
        let node = format!("lastcall-test-{}-{port}@localhost", std::process::id());
        let dir =
            std::env::temp_dir().join(format!("lastcall-rabbit-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut me = Self {
            dir,
            node,
            port,
            child: None,
        };
        let conf_file = me.dir.join("rabbitmq.conf");
        std::fs::write(&conf_file, conf(port)).unwrap();
        std::fs::write(me.dir.join("enabled_plugins"), "[].\n").unwrap();
        // Not /etc/rabbitmq/rabbitmq-env.conf, which names the shared node.
        std::fs::write(me.dir.join("rabbitmq-env.conf"), "").unwrap();
        let log = std::fs::File::create(me.dir.join("server.out")).unwrap();
        let child = me
            .env(&mut Command::new(format!("{RABBIT_BIN}/rabbitmq-server")))
            .env("RABBITMQ_NODE_PORT", free_port().to_string())
            .env("RABBITMQ_DIST_PORT", free_port().to_string())
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}",
            )
            .env("RABBITMQ_MNESIA_BASE", me.dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", me.dir.join("log"))
            .env("RABBITMQ_CONFIG_FILE", &conf_file)
            .env(
                "RABBITMQ_ADVANCED_CONFIG_FILE",
                me.dir.join("advanced.config"),
            )
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                me.dir.join("enabled_plugins"),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("rabbitmq-server (RabbitMQ must be installed)");
        me.child = Some(child);
        me.wait_ready(Duration::from_secs(120));
        me
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
        let _ = self.ctl(&["stop", pid_file.to_str().unwrap()]);
        if let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok())
            // Still this node's VM (stop failed), not a reused pid.
            && std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&self.node))
        {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
