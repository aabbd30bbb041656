//! A small blocking HTTP client for tests and the demo (loopback only, no
//! proxies from the environment, statuses returned rather than raised).

use std::time::Duration;

use anyhow::{Context, Result};

/// A response reduced to what tests look at.
#[derive(Debug, Clone)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// Headers, names lower-case, in order.
    pub headers: Vec<(String, String)>,
    /// Body as text.
    pub body: String,
    /// Body as received (compressed bodies are not decoded).
    pub raw: Vec<u8>,
}

impl Reply {
    /// The body with its `content-encoding` (gzip or none) undone.
    pub fn decoded(&self) -> Result<Vec<u8>> {
        match self.header("content-encoding") {
            None => Ok(self.raw.clone()),
            Some(coding) if coding.eq_ignore_ascii_case("gzip") => {
                use std::io::Read;
                let mut out = Vec::new();
                flate2::read::GzDecoder::new(&self.raw[..])
                    .read_to_end(&mut out)
                    .context("decoding the gzip body")?;
                Ok(out)
            }
            Some(other) => anyhow::bail!("content-encoding {other}: not decodable here"),
        }
    }

    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Sends requests; cheap to clone.
#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
}

impl Default for Client {
    fn default() -> Self {
        Self::new()
    }
}

impl Client {
    /// A client with a 30 s overall timeout.
    pub fn new() -> Self {
        Self::with_timeout(Duration::from_secs(30))
    }

    /// A client whose every request fails after `timeout` (a hang is an
    /// error, not a stuck test).
    pub fn with_timeout(timeout: Duration) -> Self {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .timeout_global(Some(timeout))
            .build();
        Client {
            agent: config.into(),
        }
    }

    /// `GET url` with extra headers.
    pub fn get(&self, url: &str, headers: &[(&str, &str)]) -> Result<Reply> {
        let mut request = self.agent.get(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        reply(request.call().with_context(|| format!("GET {url}"))?)
    }

    /// `method url` with extra headers and a body.
    pub fn send(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<Reply> {
        reply(
            self.agent
                .run(request(method, url, headers, body)?)
                .with_context(|| format!("{method} {url}"))?,
        )
    }
}

impl Client {
    /// `POST url` with `body` sent chunked (`transfer-encoding: chunked`,
    /// no `content-length`), as a client streaming its upload does.
    pub fn post_chunked(&self, url: &str, headers: &[(&str, &str)], body: &[u8]) -> Result<Reply> {
        let mut request = self.agent.post(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let mut reader = body;
        let response = request
            .send(ureq::SendBody::from_reader(&mut reader))
            .with_context(|| format!("POST {url} (chunked)"))?;
        reply(response)
    }
}

/// Whether `err` is the peer closing or resetting the connection before
/// answering: what a client meets when a server closes an idle keep-alive
/// connection as it sends (RFC 9112 §9.3.1), and retries.
pub fn is_connection_reset(err: &anyhow::Error) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    let closed = |io: &std::io::Error| {
        matches!(
            io.kind(),
            ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof
        )
    };
    err.chain().any(|cause| {
        cause.downcast_ref::<std::io::Error>().is_some_and(closed)
            || matches!(cause.downcast_ref::<ureq::Error>(), Some(ureq::Error::Io(io)) if closed(io))
    })
}

/// A response whose body may have been cut off.
#[derive(Debug, Clone)]
pub struct Partial {
    /// Status and headers, with the body as far as it arrived (lossy text).
    pub reply: Reply,
    /// Why reading the body stopped early, if it did.
    pub cut: Option<String>,
}

impl Client {
    /// Like [`Client::send`], but a body that breaks off (the connection
    /// reset mid-stream) is returned as far as it came, with the reason.
    pub fn send_partial(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<Partial> {
        let response = self
            .agent
            .run(request(method, url, headers, body)?)
            .with_context(|| format!("{method} {url}"))?;
        Ok(read(response))
    }
}

fn request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<ureq::http::Request<String>> {
    let mut request = ureq::http::Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request
        .body(body.to_string())
        .context("building the request")
}

/// Reads status, headers and as much of the body as arrives.
fn read(mut response: ureq::http::Response<ureq::Body>) -> Partial {
    use std::io::Read;
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(n, v)| {
            (
                n.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let mut bytes = Vec::new();
    let mut reader = response.body_mut().as_reader();
    let mut chunk = [0u8; 4096];
    let cut = loop {
        match reader.read(&mut chunk) {
            Ok(0) => break None,
            Ok(n) => bytes.extend_from_slice(&chunk[..n]),
            Err(err) => break Some(err.to_string()),
        }
    };
    Partial {
        reply: Reply {
            status,
            headers,
            body: String::from_utf8_lossy(&bytes).into_owned(),
            raw: bytes,
        },
        cut,
    }
}

fn reply(response: ureq::http::Response<ureq::Body>) -> Result<Reply> {
    let partial = read(response);
    match partial.cut {
        Some(err) => Err(anyhow::anyhow!("reading the body: {err}")),
        None => Ok(partial.reply),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that closes the connection with the request unread (as an
    /// nginx worker closing an idle keep-alive connection at a reload) is
    /// recognised as a reset; an answer, even an error status, is not.
    #[test]
    fn a_connection_closed_unread_is_a_reset_and_an_answer_is_not() -> Result<()> {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let url = format!("http://{}/v1/messages", listener.local_addr()?);
        let server = std::thread::spawn(move || -> std::io::Result<()> {
            let (mut socket, _) = listener.accept()?;
            let mut first = [0u8; 1];
            // Unread bytes left in the socket make the close a reset.
            socket.read_exact(&mut first)?;
            Ok(())
        });
        let err = Client::new()
            .send("POST", &url, &[], &"x".repeat(64 * 1024))
            .expect_err("the server answered nothing");
        server.join().expect("server thread")?;
        assert!(is_connection_reset(&err), "{err:#}");
        let refused = anyhow::anyhow!("429 Too Many Requests");
        assert!(!is_connection_reset(&refused));
        Ok(())
    }
}
