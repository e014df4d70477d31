use super::*;

fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("relay-tokens-{name}-"))
        .tempdir()
        .expect("tempdir")
}

#[test]
fn add_creates_a_store_the_server_loads_and_the_new_token_opens_its_tunnel_id() {
    let dir = scratch("add");
    let path = dir.path().join("tokens.toml");
    let a = add(&path, "acme-scm").expect("add");
    assert!(a.created);
    assert!(a.token.starts_with(TOKEN_PREFIX), "{}", a.token);
    assert_eq!(a.token.len(), TOKEN_PREFIX.len() + 43);
    let store = TokenStore::load(&path).expect("the server loads it");
    assert_eq!(store.lookup(&a.token), Some("acme-scm"));
    assert_eq!(store.len(), 1);
    // The file holds the hash, never the token.
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!text.contains(&a.token), "{text}");
    assert!(text.contains(&a.entry.sha256), "{text}");
    assert!(
        text.starts_with("# relay token store"),
        "header first:\n{text}"
    );

    let b = add(&path, "acme-scm").expect("second add");
    assert!(!b.created);
    assert_ne!(a.token, b.token);
    assert_eq!(b.tokens_of_tunnel, 2);
    let store = TokenStore::load(&path).unwrap();
    assert_eq!(store.lookup(&a.token), Some("acme-scm"));
    assert_eq!(store.lookup(&b.token), Some("acme-scm"));
}

#[test]
fn add_keeps_comments_existing_entries_and_the_file_mode() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = scratch("keep");
    let path = dir.path().join("tokens.toml");
    let old = format!(
        "# fleet tokens, owned by the platform team\n\n# demo agent\n[[tokens]]\ntunnel_id = \"demo\"\nsha256 = \"{}\"\n",
        sha256_hex(b"dev-token")
    );
    std::fs::write(&path, &old).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
    let a = add(&path, "acme-scm").expect("add");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with(&old), "old text kept verbatim:\n{text}");
    let store = TokenStore::load(&path).unwrap();
    assert_eq!(store.lookup("dev-token"), Some("demo"));
    assert_eq!(store.lookup(&a.token), Some("acme-scm"));
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o640);
}

#[test]
fn add_appends_to_an_inline_list_too() {
    let dir = scratch("inline");
    let path = dir.path().join("tokens.toml");
    std::fs::write(
        &path,
        format!(
            "tokens = [{{ tunnel_id = \"demo\", sha256 = \"{}\" }}]\n",
            sha256_hex(b"dev-token")
        ),
    )
    .unwrap();
    let a = add(&path, "x").expect("add");
    let store = TokenStore::load(&path).unwrap();
    assert_eq!(store.lookup(&a.token), Some("x"));
    assert_eq!(store.lookup("dev-token"), Some("demo"));
    let gone = revoke(&path, Some("demo"), None).expect("revoke");
    assert_eq!(gone.len(), 1);
    assert_eq!(TokenStore::load(&path).unwrap().lookup("dev-token"), None);
}

#[test]
fn revoke_by_tunnel_id_removes_each_of_its_tokens_and_nothing_else() {
    let dir = scratch("revoke-id");
    let path = dir.path().join("tokens.toml");
    let a1 = add(&path, "acme").unwrap();
    let a2 = add(&path, "acme").unwrap();
    let b = add(&path, "beta").unwrap();
    let gone = revoke(&path, Some("acme"), None).expect("revoke");
    assert_eq!(gone.len(), 2);
    let store = TokenStore::load(&path).unwrap();
    assert_eq!(store.lookup(&a1.token), None);
    assert_eq!(store.lookup(&a2.token), None);
    assert_eq!(store.lookup(&b.token), Some("beta"));
}

#[test]
fn revoke_by_hash_prefix_removes_one_token_of_a_rotating_tunnel_id() {
    let dir = scratch("revoke-hash");
    let path = dir.path().join("tokens.toml");
    let old = add(&path, "acme").unwrap();
    let new = add(&path, "acme").unwrap();
    let prefix = old.entry.sha256[..12].to_ascii_uppercase();
    let gone = revoke(&path, None, Some(&prefix)).expect("revoke");
    assert_eq!(gone, vec![old.entry.clone()]);
    let store = TokenStore::load(&path).unwrap();
    assert_eq!(store.lookup(&old.token), None);
    assert_eq!(store.lookup(&new.token), Some("acme"));
}

#[test]
fn revoke_errors_name_the_problem_and_leave_the_store_alone() {
    let dir = scratch("revoke-err");
    let path = dir.path().join("tokens.toml");
    let a = add(&path, "acme").unwrap();
    let before = std::fs::read_to_string(&path).unwrap();

    let e = revoke(&path, Some("nobody"), None).unwrap_err().to_string();
    assert!(
        e.contains("no entry") && e.contains("\"nobody\"") && e.contains("acme (1)"),
        "{e}"
    );
    let e = revoke(&path, None, Some("abc")).unwrap_err().to_string();
    assert!(e.contains("\"abc\"") && e.contains("at least 8"), "{e}");
    let e = revoke(&path, None, Some("zzzzzzzzzz"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not valid"), "{e}");
    // Both given: the hash must belong to that tunnel id.
    let e = revoke(&path, Some("other"), Some(&a.entry.sha256))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no entry"), "{e}");
    let e = revoke(&dir.path().join("missing.toml"), Some("acme"), None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("does not exist") && e.contains("missing.toml"),
        "{e}"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), before);
}

#[test]
fn an_ambiguous_hash_prefix_is_refused() {
    let dir = scratch("ambiguous");
    let path = dir.path().join("tokens.toml");
    // Two entries whose hashes share a prefix (written by hand: generated ones would not).
    let h1 = format!("{}{}", "ab".repeat(8), "1".repeat(48));
    let h2 = format!("{}{}", "ab".repeat(8), "2".repeat(48));
    std::fs::write(
        &path,
        format!(
            "[[tokens]]\ntunnel_id = \"a\"\nsha256 = \"{h1}\"\n[[tokens]]\ntunnel_id = \"b\"\nsha256 = \"{h2}\"\n"
        ),
    )
    .unwrap();
    let e = revoke(&path, None, Some("abababab"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("matches 2 entries"), "{e}");
    assert_eq!(revoke(&path, None, Some(&h2)).unwrap().len(), 1);
}

#[test]
fn an_invalid_store_is_not_edited_and_the_error_names_the_key() {
    let dir = scratch("invalid");
    let path = dir.path().join("tokens.toml");
    let bad = "[[tokens]]\ntunnel_id = \"demo\"\nsha256 = \"xyz\"\n";
    std::fs::write(&path, bad).unwrap();
    let e = add(&path, "acme").unwrap_err().to_string();
    assert!(e.contains("tokens[0].sha256"), "{e}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), bad);
    let e = add(&path, "not a valid id").unwrap_err().to_string();
    assert!(e.contains("\"not a valid id\""), "{e}");
}

#[test]
fn concurrent_adds_keep_every_token() {
    let dir = scratch("concurrent");
    let path = dir.path().join("tokens.toml");
    let tokens: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let path = path.clone();
                s.spawn(move || add(&path, &format!("t{i}")).expect("add").token)
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let store = TokenStore::load(&path).unwrap();
    assert_eq!(store.len(), 8);
    for t in &tokens {
        assert!(store.lookup(t).is_some());
    }
    assert_eq!(list(&path).unwrap().len(), 8);
}

#[test]
fn revoking_the_first_entry_keeps_the_file_header_and_drops_its_own_comment() {
    let dir = scratch("header");
    let path = dir.path().join("tokens.toml");
    let a = add(&path, "first").unwrap();
    let b = add(&path, "second").unwrap();
    revoke(&path, Some("first"), None).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("# relay token store"), "{text}");
    assert!(!text.contains("# first:"), "{text}");
    assert!(text.contains("# second:"), "{text}");
    assert_eq!(
        TokenStore::load(&path).unwrap().lookup(&b.token),
        Some("second")
    );
    revoke(&path, None, Some(&b.entry.sha256)).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("# relay token store"), "{text}");
    assert!(TokenStore::load(&path).unwrap().is_empty());
    // And the store grows again from there, below its header.
    let c = add(&path, "third").unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("# relay token store"), "{text}");
    assert_eq!(
        TokenStore::load(&path).unwrap().lookup(&c.token),
        Some("third")
    );
    assert_eq!(TokenStore::load(&path).unwrap().lookup(&a.token), None);
}
