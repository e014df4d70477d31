//! A throwaway TLS set for the relay (tests, `relay-fleet certs`, `examples/tls/`): one CA,
//! server certificates for the dispatcher and the tunnel servers, and client certificates
//! for the two mutual-TLS hops. Generated fresh each time with
//! `relay_common::devcerts`; never meant for production.

use relay_common::devcerts::{write, DevCa};
use relay_common::tls::{ClientTls, DialerTls, ListenerTls, ServerTls};
use std::path::{Path, PathBuf};

/// The name in the dispatcher's client certificate (tunnel servers' `[forward_tls]
/// client_names`).
pub const DISPATCHER_CLIENT: &str = "dispatcher";

/// The role name in the tunnel servers' client certificate (the dispatcher's
/// `[registry_tls] client_names`).
pub const TUNNEL_SERVER_CLIENT: &str = "tunnel-server";

/// The files of a generated set (all PEM).
#[derive(Clone, Debug)]
pub struct CertSet {
    pub dir: PathBuf,
    /// The CA every certificate of the set chains to.
    pub ca: PathBuf,
    /// Server certificate of the dispatcher (HTTP front and registry listener).
    pub dispatcher: (PathBuf, PathBuf),
    /// Client certificate the dispatcher presents to tunnel servers (`Forward.Call`).
    pub dispatcher_client: (PathBuf, PathBuf),
    /// Server certificate of the tunnel servers (agent and forward listeners).
    pub tunnel_server: (PathBuf, PathBuf),
    /// Client certificate tunnel servers present to the dispatcher (`Registry.Report`).
    pub tunnel_server_client: (PathBuf, PathBuf),
    /// A client certificate of the same CA for an agent (`[agent_tls] client_ca`), naming
    /// `agent-demo`: what a shared CA also signs, which the mutual-TLS hops must refuse.
    pub agent_client: (PathBuf, PathBuf),
}

/// Writes a new set into `dir` (created if missing). `names`: DNS names or IP addresses
/// the server certificates are valid for.
pub fn generate(dir: &Path, names: &[&str]) -> anyhow::Result<CertSet> {
    std::fs::create_dir_all(dir)?;
    let ca = DevCa::new("relay example CA")?;
    let pair =
        |name: &str, leaf: relay_common::devcerts::Leaf| -> anyhow::Result<(PathBuf, PathBuf)> {
            Ok((
                write(dir, &format!("{name}.pem"), &leaf.cert_pem)?,
                write(dir, &format!("{name}.key"), &leaf.key_pem)?,
            ))
        };
    Ok(CertSet {
        dir: dir.to_path_buf(),
        ca: write(dir, "ca.pem", &ca.cert_pem)?,
        dispatcher: pair("dispatcher", ca.server(names)?)?,
        dispatcher_client: pair("dispatcher-client", ca.client(DISPATCHER_CLIENT)?)?,
        tunnel_server: pair("tunnel-server", ca.server(names)?)?,
        // Names the role and the first test server's id (`[registry] server_id_in_cert`).
        tunnel_server_client: pair(
            "tunnel-server-client",
            ca.client_for(&[TUNNEL_SERVER_CLIENT, "ts-1"])?,
        )?,
        agent_client: pair("agent-client", ca.client("agent-demo")?)?,
    })
}

impl CertSet {
    /// A listener with `pair`; with `clients`, mutual TLS pinned to those names.
    fn server(&self, (cert, key): &(PathBuf, PathBuf), clients: Option<&str>) -> ListenerTls {
        ListenerTls::tls(ServerTls {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: clients.map(|_| self.ca.clone()),
            client_cert_optional: false,
            client_names: clients.map(|n| vec![n.to_string()]).unwrap_or_default(),
        })
    }

    fn client(&self, pair: Option<&(PathBuf, PathBuf)>) -> DialerTls {
        DialerTls::tls(ClientTls {
            ca: Some(self.ca.clone()),
            cert: pair.map(|p| p.0.clone()),
            key: pair.map(|p| p.1.clone()),
            server_name: None,
        })
    }

    /// Dispatcher `[tls]` (the HTTP front; no client certificates).
    pub fn dispatcher_front(&self) -> ListenerTls {
        self.server(&self.dispatcher, None)
    }

    /// Dispatcher `[registry_tls]` (mutual TLS, pinned to the tunnel servers' client
    /// certificate).
    pub fn dispatcher_registry(&self) -> ListenerTls {
        self.server(&self.dispatcher, Some(TUNNEL_SERVER_CLIENT))
    }

    /// Dispatcher `[forward_tls]` (with its client certificate).
    pub fn dispatcher_forward(&self) -> DialerTls {
        self.client(Some(&self.dispatcher_client))
    }

    /// Tunnel server `[agent_tls]` (server authentication only).
    pub fn tunnel_agent(&self) -> ListenerTls {
        self.server(&self.tunnel_server, None)
    }

    /// Tunnel server `[forward_tls]` (mutual TLS, pinned to the dispatcher's client
    /// certificate).
    pub fn tunnel_forward(&self) -> ListenerTls {
        self.server(&self.tunnel_server, Some(DISPATCHER_CLIENT))
    }

    /// Tunnel server `[dispatcher_tls]` (with its client certificate).
    pub fn tunnel_dispatcher(&self) -> DialerTls {
        self.client(Some(&self.tunnel_server_client))
    }

    /// Agent `[tls]` (trusts the CA; no client certificate).
    pub fn agent(&self) -> DialerTls {
        self.client(None)
    }

    /// A backend's client config for the dispatcher front.
    pub fn backend(&self) -> ClientTls {
        ClientTls {
            ca: Some(self.ca.clone()),
            ..Default::default()
        }
    }
}
