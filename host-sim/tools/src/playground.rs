//! `host-sim playground`: a small static file server for the rule
//! playground page (`cargo xtask build-playground` builds it into
//! `target/playground/`). GET and HEAD only, files under one directory only
//! (no `..`, no symlinks out of it), content types a browser needs to run a
//! WebAssembly module (`application/wasm`, `text/javascript`). Loopback by
//! default.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CACHE_CONTROL, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use tokio::net::TcpListener;

/// Where `host-sim playground` listens unless told otherwise.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8787";
/// What it serves unless told otherwise (relative to the working directory).
pub const DEFAULT_DIR: &str = "target/playground";

/// `host-sim playground`'s usage lines.
pub const USAGE: &str = "\
usage: host-sim playground [--listen ADDR] [--dir DIR]
  Serve the rule playground page built by `cargo xtask build-playground`
  (DIR, default target/playground) on ADDR (default 127.0.0.1:8787).
";

/// Runs `host-sim playground [--listen ADDR] [--dir DIR]` until killed.
pub fn main(args: &[String]) -> Result<()> {
    let mut listen = DEFAULT_LISTEN.to_string();
    let mut dir = PathBuf::from(DEFAULT_DIR);
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "--help" | "-h" => {
                print!("{USAGE}");
                return Ok(());
            }
            "--listen" => listen = iter.next().context("--listen needs IP:PORT")?.clone(),
            "--dir" => dir = PathBuf::from(iter.next().context("--dir needs a directory")?),
            other => bail!("unexpected argument {other:?}\n{USAGE}"),
        }
    }
    let listen: SocketAddr = listen
        .parse()
        .with_context(|| format!("--listen: expected IP:PORT, got {listen:?}"))?;
    let server = Server::start(listen, &dir)?;
    eprintln!(
        "host-sim playground: serving {} on http://{}/",
        server.dir().display(),
        server.addr()
    );
    server.wait();
    Ok(())
}

/// A running playground server; stops when dropped.
pub struct Server {
    addr: SocketAddr,
    dir: PathBuf,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Server {
    /// Serves `dir` (which must hold `index.html`) on `listen` (port 0 picks
    /// a free one).
    pub fn start(listen: SocketAddr, dir: &Path) -> Result<Server> {
        let dir = dir.canonicalize().with_context(|| {
            format!(
                "{} not found: build the page with `cargo xtask build-playground` (or pass --dir DIR)",
                dir.display()
            )
        })?;
        if !dir.join("index.html").is_file() {
            bail!(
                "{} has no index.html: build the page with `cargo xtask build-playground`",
                dir.display()
            );
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let listener = runtime
            .block_on(TcpListener::bind(listen))
            .with_context(|| format!("binding {listen}"))?;
        let addr = listener.local_addr()?;
        let served = dir.clone();
        let _inside = runtime.enter();
        crate::loopback::serve(listener, move |request| {
            let dir = served.clone();
            async move { respond(&dir, &request).await }
        });
        Ok(Server {
            addr,
            dir,
            runtime: Some(runtime),
        })
    }

    /// The listener address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The directory served (canonical).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Blocks for as long as the process runs.
    pub fn wait(self) {
        loop {
            std::thread::park();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn respond(dir: &Path, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "GET or HEAD only\n");
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    let Some(relative) = relative_path(request.uri().path()) else {
        return text(StatusCode::FORBIDDEN, "forbidden path\n");
    };
    let dir = dir.to_path_buf();
    let found = tokio::task::spawn_blocking(move || {
        // Symlinks could still lead out of `dir`: compare the real path.
        let real = dir.join(&relative).canonicalize().ok()?;
        if !real.starts_with(&dir) {
            return Some(Err(()));
        }
        let body = std::fs::read(&real).ok()?;
        Some(Ok((real, body)))
    })
    .await;
    let (real, body) = match found {
        Ok(Some(Ok(file))) => file,
        Ok(Some(Err(()))) => return text(StatusCode::FORBIDDEN, "forbidden path\n"),
        Ok(None) | Err(_) => return text(StatusCode::NOT_FOUND, "not found\n"),
    };
    // For HEAD, hyper sends the headers (length included) and drops the body.
    let length = body.len();
    let mut response = Response::new(Full::new(Bytes::from(body)));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type(&real)));
    headers.insert(CONTENT_LENGTH, HeaderValue::from(length));
    // A rebuilt page shows at the next reload.
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    response
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// The file a URL path names, relative to the served directory: `/` and
/// paths ending in `/` name their `index.html`; percent-escapes are decoded.
/// `None` for anything that could step outside: `..` or `.` segments, a
/// backslash, a NUL, escapes that do not decode to UTF-8.
pub fn relative_path(url_path: &str) -> Option<PathBuf> {
    let decoded = percent_decode(url_path)?;
    if !decoded.starts_with('/') || decoded.contains(['\\', '\0']) {
        return None;
    }
    let mut relative = PathBuf::new();
    for segment in decoded.split('/').filter(|s| !s.is_empty()) {
        if segment == ".." || segment == "." {
            return None;
        }
        relative.push(segment);
    }
    if decoded.ends_with('/') {
        relative.push("index.html");
    }
    Some(relative)
}

fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The `Content-Type` for a file, by extension.
pub fn content_type(path: &Path) -> &'static str {
    let extension = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match extension.as_deref() {
        Some("html" | "htm") => "text/html; charset=utf-8",
        Some("js" | "mjs") => "text/javascript; charset=utf-8",
        Some("wasm") => "application/wasm",
        Some("css") => "text/css; charset=utf-8",
        Some("json") => "application/json",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("ico") => "image/x-icon",
        Some("txt" | "md") => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpStream;

    use super::*;

    /// Sends `request` as raw bytes (no client-side path normalisation) and
    /// returns the response's status line, headers and body as text.
    fn raw(addr: SocketAddr, request: &str) -> String {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).unwrap();
        out
    }

    fn get(addr: SocketAddr, path: &str) -> String {
        raw(
            addr,
            &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        )
    }

    #[test]
    fn maps_url_paths_inside_the_directory_only() {
        assert_eq!(relative_path("/"), Some(PathBuf::from("index.html")));
        assert_eq!(
            relative_path("/a/b.js"),
            Some(PathBuf::from("a").join("b.js"))
        );
        assert_eq!(
            relative_path("/a//b/"),
            Some(PathBuf::from("a/b/index.html"))
        );
        assert_eq!(
            relative_path("/my%20page.html"),
            Some(PathBuf::from("my page.html"))
        );
        for bad in [
            "/../etc/passwd",
            "/a/../../x",
            "/%2e%2e/x",
            "/%2E%2E%2fx",
            "/a/./b",
            "/..%5cx",
            "/x%00.html",
            "/%zz",
            "/%e9",
            "/%",
            "relative",
        ] {
            assert_eq!(relative_path(bad), None, "{bad}");
        }
    }

    #[test]
    fn serves_files_with_their_content_types_and_refuses_the_rest() {
        let outer = tempfile::tempdir().unwrap();
        let dir = outer.path().join("www");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("index.html"), "<h1>hi</h1>").unwrap();
        std::fs::write(dir.join("app.js"), "export {}").unwrap();
        std::fs::write(dir.join("engine_bg.wasm"), b"\0asm\x01\0\0\0").unwrap();
        std::fs::write(outer.path().join("secret.txt"), "secret").unwrap();
        std::os::unix::fs::symlink(outer.path().join("secret.txt"), dir.join("link.txt")).unwrap();

        let server = Server::start("127.0.0.1:0".parse().unwrap(), &dir).unwrap();
        let addr = server.addr();
        assert!(addr.ip().is_loopback());

        let index = get(addr, "/");
        assert!(index.starts_with("HTTP/1.1 200"), "{index}");
        assert!(index.contains("content-type: text/html; charset=utf-8"));
        assert!(index.ends_with("<h1>hi</h1>"));
        let wasm = get(addr, "/engine_bg.wasm?v=1");
        assert!(wasm.contains("content-type: application/wasm"), "{wasm}");
        assert!(wasm.contains("content-length: 8"), "{wasm}");
        let js = get(addr, "/app.js");
        assert!(js.contains("content-type: text/javascript"), "{js}");

        for path in ["/../secret.txt", "/%2e%2e/secret.txt", "/link.txt"] {
            let reply = get(addr, path);
            assert!(reply.starts_with("HTTP/1.1 403"), "{path}: {reply}");
            assert!(!reply.contains("secret\n") && !reply.ends_with("secret"));
        }
        assert!(get(addr, "/missing.js").starts_with("HTTP/1.1 404"));
        let post = raw(
            addr,
            "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        );
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        assert!(post.contains("allow: GET, HEAD"));
        let head = raw(
            addr,
            "HEAD /app.js HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        );
        assert!(
            head.starts_with("HTTP/1.1 200") && head.contains("content-length: 9"),
            "{head}"
        );
        assert!(head.ends_with("\r\n\r\n"), "{head}");
    }

    #[test]
    fn refuses_a_directory_without_the_page() {
        let dir = tempfile::tempdir().unwrap();
        let err = Server::start("127.0.0.1:0".parse().unwrap(), dir.path())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("cargo xtask build-playground"), "{err}");
        let missing = dir.path().join("nope");
        let err = Server::start("127.0.0.1:0".parse().unwrap(), &missing)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("not found"), "{err}");
    }
}
