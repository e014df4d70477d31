//! A `redis-server` of the test's own on a free loopback port, for the shared-registry
//! tests: started empty (in plain text, or TLS only with [`RedisServer::start_tls`]),
//! restarted empty on the same port, frozen (SIGSTOP: its sockets stay open and nothing
//! answers) and thawed, and killed on drop.
//!
//! Without the binary a test fails and says how to install it ([`require_redis`]): a test
//! that needs Redis never passes without it. This module must not decide what a test
//! asserts.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Fails the test, saying how to install it, when `redis-server` cannot be run.
pub fn require_redis(test: &str) {
    let found = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "{test}: redis-server is not installed or not on PATH: install the Debian package \
         (`apt-get install redis-server`; scripts/test does), or point RELAY_TEST_REDIS_URL at a \
         running Redis where the test accepts a shared instance"
    );
}

/// A `redis-server` child on a free loopback port; killed on drop.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    tls: Option<RedisTlsFiles>,
    /// `--requirepass`, when set.
    password: Option<String>,
}

/// PEM files of a TLS-only Redis (`--port 0 --tls-port`), which asks no client certificate.
#[derive(Clone, Debug)]
pub struct RedisTlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Required by redis-server's TLS setup; clients are not asked for a certificate.
    pub ca: PathBuf,
}

impl RedisServer {
    /// Starts one (see [`require_redis`] for a clear failure without the binary).
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    /// Starts one that speaks TLS only; [`RedisServer::url`] is then `rediss://`.
    pub async fn start_tls(files: RedisTlsFiles) -> Self {
        Self::start_with(Some(files)).await
    }

    /// Starts one that requires `password` (`AUTH`); the URL then carries it.
    pub async fn start_with_password(password: &str) -> Self {
        Self::start_as(None, Some(password.to_string())).await
    }

    async fn start_with(tls: Option<RedisTlsFiles>) -> Self {
        Self::start_as(tls, None).await
    }

    async fn start_as(tls: Option<RedisTlsFiles>, password: Option<String>) -> Self {
        // Redis cannot bind port 0: take a free port from the OS and release it.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let dir =
            std::env::temp_dir().join(format!("relay-test-redis-{}-{port}", std::process::id()));
        let mut r = RedisServer {
            child: None,
            port,
            dir,
            tls,
            password,
        };
        r.restart().await;
        r
    }

    /// `redis://127.0.0.1:<port>`, or `rediss://` for a TLS one.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        match &self.password {
            Some(pw) => format!("{scheme}://:{pw}@127.0.0.1:{}", self.port),
            None => format!("{scheme}://127.0.0.1:{}", self.port),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// (Re)starts the server on its port with an empty data set.
    pub async fn restart(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
        std::fs::create_dir_all(&self.dir).unwrap();
        let mut cmd = Command::new("redis-server");
        match &self.tls {
            None => cmd.args(["--port", &self.port.to_string()]),
            Some(t) => cmd
                .args(["--port", "0", "--tls-port", &self.port.to_string()])
                .arg("--tls-cert-file")
                .arg(&t.cert)
                .arg("--tls-key-file")
                .arg(&t.key)
                .arg("--tls-ca-cert-file")
                .arg(&t.ca)
                .args(["--tls-auth-clients", "no"]),
        };
        if let Some(pw) = &self.password {
            cmd.args(["--requirepass", pw]);
        }
        let child = cmd
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        // With TLS or a password a bare PING gets no PONG: a connection is enough.
        let (port, tls) = (self.port, self.tls.is_some() || self.password.is_some());
        crate::eventually(
            "redis-server answers PING (with TLS or a password: accepts connections)",
            Duration::from_secs(10),
            || async move {
                if tls {
                    tokio::net::TcpStream::connect(("127.0.0.1", port))
                        .await
                        .is_ok()
                } else {
                    ping(port).await
                }
            },
        )
        .await;
    }

    /// Kills it (its data is gone).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP: the process stays, its sockets stay open (the kernel still accepts
    /// connections into the backlog), and nothing is answered until [`RedisServer::thaw`].
    pub fn freeze(&self) {
        self.signal("STOP");
    }

    /// SIGCONT after [`RedisServer::freeze`].
    pub fn thaw(&self) {
        self.signal("CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("redis-server runs").id();
        let ok = Command::new("kill")
            .args(["-s", sig, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -s {sig} {pid} (redis-server) failed");
    }

    /// Whether it answers PING within 500 ms.
    pub async fn answers(&self) -> bool {
        ping(self.port).await
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if self.child.is_some() {
            // A frozen process dies on SIGKILL too; continue it so it is reaped at once.
            let _ = self.child.as_ref().map(|c| {
                Command::new("kill")
                    .args(["-s", "CONT", &c.id().to_string()])
                    .status()
            });
        }
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn ping(port: u16) -> bool {
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        s.write_all(b"PING\r\n").await.ok()?;
        let mut buf = [0u8; 7];
        s.read_exact(&mut buf).await.ok()?;
        Some(&buf == b"+PONG\r\n")
    };
    tokio::time::timeout(Duration::from_millis(500), attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}
