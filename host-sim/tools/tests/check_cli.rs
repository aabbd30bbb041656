//! `host-sim check` as an operator runs it before a reload or deploy: every
//! shipped configuration passes (`OK FILE`, exit 0), and each deliberately
//! broken copy fails (exit 1) with the one line naming the file and the
//! field. The Wasm modules are stand-ins (the Wasm magic number only: the
//! check reads no module), so no build of the filters is needed; nothing
//! touches the network.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, Result, ensure};

/// A secret long enough for post-cache (at least 32 bytes).
const SECRET: &str = "0123456789abcdef0123456789abcdef-check";

/// The modules the shipped configurations name.
const MODULES: [&str; 7] = [
    "activation",
    "lazy_auth",
    "post_cache",
    "metering",
    "quota",
    "fused",
    "observer_service",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A deployment in a temporary directory: `envoy/` and `kong/` copied from
/// the repository, stand-in modules where the build would put them.
fn deployment() -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    for sub in ["envoy", "kong"] {
        std::fs::create_dir_all(dir.path().join(sub))?;
        for entry in std::fs::read_dir(root().join(sub))? {
            let path = entry?.path();
            if path.is_file() {
                std::fs::copy(&path, dir.path().join(sub).join(path.file_name().unwrap()))?;
            }
        }
    }
    let wasm = dir.path().join("target/wasm32-wasip1/wasm");
    std::fs::create_dir_all(&wasm)?;
    for module in MODULES {
        std::fs::write(
            wasm.join(format!("zerolayer_{module}.wasm")),
            b"\0asm\x01\0\0\0",
        )?;
    }
    Ok(dir)
}

/// Runs `host-sim check ARGS` in `dir` with only the environment given.
fn check(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<Output> {
    let mut command = Command::new(env!("CARGO_BIN_EXE_host-sim"));
    command.arg("check").args(args).current_dir(dir).env_clear();
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().context("running host-sim check")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Replaces the one occurrence of `from` in `dir/file` by `to`.
fn edit(dir: &Path, file: &str, from: &str, to: &str) -> Result<()> {
    let path = dir.join(file);
    let text = std::fs::read_to_string(&path)?;
    ensure!(
        text.matches(from).count() == 1,
        "{file}: expected exactly one {from:?} to edit"
    );
    std::fs::write(&path, text.replacen(from, to, 1))?;
    Ok(())
}

#[test]
fn every_shipped_configuration_passes() -> Result<()> {
    let dir = deployment()?;
    let base = dir.path().to_str().context("temp path")?;
    let root = root();
    let mut args = vec!["--base".to_string(), base.to_string()];
    let mut envoy = Vec::new();
    for entry in std::fs::read_dir(root.join("envoy"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            envoy.push(path.to_string_lossy().into_owned());
        }
    }
    envoy.sort();
    ensure!(
        envoy.len() >= 6,
        "the shipped Envoy configurations: {envoy:?}"
    );
    args.extend(envoy.iter().cloned());
    let file = |name: &str| root.join("kong").join(name).to_string_lossy().into_owned();
    let (yml, fused, conf) = (file("kong.yml"), file("kong-fused.yml"), file("kong.conf"));
    args.extend(["--kong".into(), yml.clone(), conf.clone()]);
    args.extend(["--kong".into(), fused.clone(), conf.clone()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = check(dir.path(), &args, &[("ZEROLAYER_CACHE_SECRET", SECRET)])?;
    let mut expected: Vec<String> = envoy.iter().map(|f| format!("OK {f}")).collect();
    expected.extend([yml, conf.clone(), fused, conf].map(|f| format!("OK {f}")));
    assert_eq!(
        stdout(&output).lines().collect::<Vec<_>>(),
        expected,
        "stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(output.status.code(), Some(0));
    Ok(())
}

/// A broken copy of a shipped configuration and what `check` must say.
struct Case {
    name: &'static str,
    /// (file, from, to): each replaces the one occurrence of `from`.
    edits: &'static [(&'static str, &'static str, &'static str)],
    /// A stand-in module to remove or spoil.
    module: Option<(&'static str, Option<&'static [u8]>)>,
    /// The cache secret given, if any.
    secret: Option<&'static str>,
    args: &'static [&'static str],
    /// Lines the output must contain: exactly, or, with a `…`, the line's
    /// start and end (where serde's message names columns or lists fields).
    lines: &'static [&'static str],
}

const CASES: &[Case] = &[
    Case {
        name: "bad JSON in a filter configuration",
        edits: &[(
            "envoy/activation.yaml",
            r#"value: '{"custom_observers""#,
            r#"value: '{,"custom_observers""#,
        )],
        module: None,
        secret: Some(SECRET),
        args: &["envoy/activation.yaml"],
        lines: &[
            "envoy/activation.yaml: activation: key must be a string at line 1 column 2 (in http filter zerolayer.activation)",
        ],
    },
    Case {
        name: "unknown field (Kong plugin config)",
        edits: &[(
            "kong/kong.yml",
            r#""max_pending":1000"#,
            r#""max_pendin":1000"#,
        )],
        module: None,
        secret: Some(SECRET),
        args: &["--kong", "kong/kong.yml", "kong/kong.conf"],
        lines: &[
            "kong/kong.yml: lazy_auth.max_pendin: unknown field `max_pendin`, expected one of …(in filter zerolayer_lazy_auth)",
        ],
    },
    Case {
        name: "wrong type",
        edits: &[(
            "envoy/zerolayer.yaml",
            r#""max_entries":1024"#,
            r#""max_entries":"many""#,
        )],
        module: None,
        secret: Some(SECRET),
        args: &["envoy/zerolayer.yaml"],
        lines: &[
            "envoy/zerolayer.yaml: post_cache.max_entries: invalid type: string \"many\", expected u32 at …(in http filter zerolayer.post_cache)",
        ],
    },
    Case {
        name: "a quota policy with a bad window",
        edits: &[(
            "kong/kong-fused.yml",
            r#""window":"day""#,
            r#""window":"fortnight""#,
        )],
        module: None,
        secret: Some(SECRET),
        args: &["--kong", "kong/kong-fused.yml", "kong/kong.conf"],
        lines: &[
            "kong/kong-fused.yml: quota.policies[0].limit.budget.window: unknown variant `fortnight`, expected one of `hour`, `day`, `month` at …(in filter zerolayer_fused)",
        ],
    },
    Case {
        name: "a hard stream on a route that buffers responses",
        edits: &[
            (
                "kong/kong-fused.yml",
                "        response_buffering: false\n",
                "",
            ),
            (
                "kong/kong-fused.yml",
                r#""unit":"tokens","limit""#,
                r#""unit":"tokens","stream":"hard","limit""#,
            ),
        ],
        module: None,
        secret: Some(SECRET),
        args: &["--kong", "kong/kong-fused.yml", "kong/kong.conf"],
        lines: &[
            "kong/kong-fused.yml: routes[llm-inference].response_buffering: true (Kong's default) where quota cuts streams (quota.policies[0].stream \"hard\" of filter zerolayer_fused): ngx_wasm_module loses a replaced chunk under buffered proxying and the worker spins; set it to false",
        ],
    },
    Case {
        name: "no cluster for the JWKS",
        edits: &[(
            "envoy/zerolayer.yaml",
            "- name: idp\n",
            "- name: identity\n",
        )],
        module: None,
        secret: Some(SECRET),
        args: &["envoy/zerolayer.yaml"],
        lines: &[
            "envoy/zerolayer.yaml: lazy_auth.jwt.jwks.cluster: no cluster \"idp\" in static_resources.clusters (in bootstrap extension zerolayer.observer)",
            "envoy/zerolayer.yaml: lazy_auth.jwt.jwks.cluster: no cluster \"idp\" in static_resources.clusters (in http filter zerolayer.lazy_auth)",
        ],
    },
    Case {
        name: "no cluster for post-cache's webdis (and no observer section for its jobs)",
        edits: &[(
            "envoy/zerolayer-fused.yaml",
            r#""post_cache":{"secret_env":"ZEROLAYER_CACHE_SECRET","#,
            r#""post_cache":{"secret_env":"ZEROLAYER_CACHE_SECRET","fleet":{"cluster":"webdis","path":"/"},"#,
        )],
        module: None,
        secret: Some(SECRET),
        args: &["envoy/zerolayer-fused.yaml"],
        lines: &[
            "envoy/zerolayer-fused.yaml: post_cache.fleet.cluster: no cluster \"webdis\" in static_resources.clusters (in http filter zerolayer)",
            "envoy/zerolayer-fused.yaml: post_cache.observer: the observer singleton on queue \"zerolayer.jobs\" has no post_cache section: it would drop this filter's jobs (in http filter zerolayer)",
        ],
    },
    Case {
        name: "no webdis address for the native module's quota thread",
        edits: &[(
            "envoy/zerolayer-native.yaml",
            r#"value: '{"activation":"#,
            r#"value: '{"quota":{"store":{"cluster":"webdis","path":"/"},"policies":[{"name":"daily","scope":["tenant"],"unit":"tokens","limit":{"budget":{"amount":1000000,"window":"day"}}}]},"activation":"#,
        )],
        module: None,
        secret: Some(SECRET),
        args: &["envoy/zerolayer-native.yaml"],
        lines: &[
            "envoy/zerolayer-native.yaml: native.upstreams: no address for cluster \"webdis\" (quota.store.cluster): the module's quota thread calls it directly (in http filter zerolayer)",
        ],
    },
    Case {
        name: "a queue no observer registers",
        edits: &[(
            "envoy/metering.yaml",
            r#""queue":"zerolayer.jobs","mode":"singleton"}}'"#,
            r#""queue":"zerolayer.usage","mode":"singleton"}}'"#,
        )],
        module: None,
        secret: Some(SECRET),
        args: &["envoy/metering.yaml"],
        lines: &[
            "envoy/metering.yaml: metering.observer.queue: no observer singleton in vm_id \"zerolayer\" registers queue \"zerolayer.usage\" (it registers \"zerolayer.jobs\") (in http filter zerolayer.metering)",
        ],
    },
    Case {
        name: "no observer singleton in the filters' vm_id",
        edits: &[(
            "envoy/metering.yaml",
            "        vm_id: zerolayer\n",
            "        vm_id: observer\n",
        )],
        module: None,
        secret: Some(SECRET),
        args: &["envoy/metering.yaml"],
        lines: &[
            "envoy/metering.yaml: metering.observer.vm_id: no observer singleton (envoy.bootstrap.wasm) runs in vm_id \"zerolayer\" (observers run in \"observer\"): queue \"zerolayer.jobs\" is never registered, the filter's jobs are lost (in http filter zerolayer.metering)",
        ],
    },
    Case {
        name: "lazy-auth outside the observer's vm_id",
        edits: &[(
            "envoy/lazy-auth.yaml",
            "                  vm_id: zerolayer\n",
            "                  vm_id: zerolayer.auth\n",
        )],
        module: None,
        secret: Some(SECRET),
        args: &["envoy/lazy-auth.yaml"],
        lines: &[
            "envoy/lazy-auth.yaml: lazy_auth.observer.vm_id: \"zerolayer\" but the filter runs in vm_id \"zerolayer.auth\" (vm_config.vm_id): the observer writes verdicts into its own vm_id's shared data (in http filter zerolayer.lazy_auth)",
        ],
    },
    Case {
        name: "the observer not a singleton",
        edits: &[(
            "envoy/lazy-auth.yaml",
            "singleton: true",
            "singleton: false",
        )],
        module: None,
        secret: Some(SECRET),
        args: &["envoy/lazy-auth.yaml"],
        lines: &[
            "envoy/lazy-auth.yaml: singleton: not true: the observer must run once per Envoy, as a singleton service (in bootstrap extension zerolayer.observer)",
        ],
    },
    Case {
        name: "a missing Wasm file",
        edits: &[],
        module: Some(("zerolayer_activation.wasm", None)),
        secret: Some(SECRET),
        args: &["envoy/activation.yaml"],
        lines: &[
            "envoy/activation.yaml: vm_config.code.local.filename: no file \"target/wasm32-wasip1/wasm/zerolayer_activation.wasm\" (resolved against .) (in http filter zerolayer.activation)",
        ],
    },
    Case {
        name: "a file that is not Wasm",
        edits: &[],
        module: Some(("zerolayer_fused.wasm", Some(b"<html>"))),
        secret: Some(SECRET),
        args: &["--kong", "kong/kong-fused.yml", "kong/kong.conf"],
        lines: &[
            "kong/kong.conf: wasm_filters_path: \"target/wasm32-wasip1/wasm/zerolayer_fused.wasm\" is not a Wasm module: Kong has no filter \"zerolayer_fused\" (filter zerolayer_fused in kong/kong-fused.yml)",
        ],
    },
    Case {
        name: "a secret's variable not set (Kong)",
        edits: &[],
        module: None,
        secret: None,
        args: &["--kong", "kong/kong.yml", "kong/kong.conf"],
        lines: &[
            "kong/kong.yml: post_cache.secret_env: environment variable \"ZEROLAYER_CACHE_SECRET\" is not set (in filter zerolayer_post_cache)",
        ],
    },
    Case {
        name: "a secret too short (native)",
        edits: &[],
        module: None,
        secret: Some("short"),
        args: &["envoy/zerolayer-native.yaml"],
        lines: &[
            "envoy/zerolayer-native.yaml: post_cache.secret_env: the secret in \"ZEROLAYER_CACHE_SECRET\" has 5 bytes; at least 32 are required (in http filter zerolayer)",
        ],
    },
    Case {
        name: "a secret's variable not passed to the VM",
        edits: &[(
            "envoy/zerolayer-fused.yaml",
            "host_env_keys: [ZEROLAYER_CACHE_SECRET, ZEROLAYER_HS256_SECRET]",
            "host_env_keys: [ZEROLAYER_HS256_SECRET]",
        )],
        module: None,
        secret: Some(SECRET),
        args: &["envoy/zerolayer-fused.yaml"],
        lines: &[
            "envoy/zerolayer-fused.yaml: post_cache.secret_env: \"ZEROLAYER_CACHE_SECRET\" is not in vm_config.environment_variables.host_env_keys: the VM would not see it (in http filter zerolayer)",
        ],
    },
    Case {
        name: "a bad activation rule",
        edits: &[(
            "envoy/zerolayer.yaml",
            r#""matches":"^/v1/(messages|chat/completions)$""#,
            r#""matches":"^/v1/(messages|chat/completions$""#,
        )],
        module: None,
        secret: Some(SECRET),
        args: &["envoy/zerolayer.yaml"],
        lines: &[
            "envoy/zerolayer.yaml: activation.rules[3].when.all[1].path.matches: invalid regex \"^/v1/(messages|chat/completions$\": unclosed group (in http filter zerolayer.activation)",
        ],
    },
    Case {
        name: "a bad field in a Kong plugin config",
        edits: &[(
            "kong/kong.yml",
            r#""openai_include_usage":true"#,
            r#""openai_include_usage":"yes""#,
        )],
        module: None,
        secret: Some(SECRET),
        args: &["--kong", "kong/kong.yml", "kong/kong.conf"],
        lines: &[
            "kong/kong.yml: metering.openai_include_usage: invalid type: string \"yes\", expected a boolean at …(in filter zerolayer_metering)",
        ],
    },
    Case {
        name: "kong.conf without the `*` shm zone",
        edits: &[("kong/kong.conf", "nginx_wasm_shm_kv = * 128m\n", "")],
        module: None,
        secret: Some(SECRET),
        args: &["--kong", "kong/kong.yml", "kong/kong.conf"],
        lines: &[
            "kong/kong.conf: nginx_wasm_shm_kv: no `*` zone: zerolayer's shared-data keys have no zone prefix, so every get/set_shared_data traps",
        ],
    },
    Case {
        name: "kong.conf without a filter's queue",
        edits: &[(
            "kong/kong.conf",
            "; shm_queue zerolayer.jobs.metering 4m\n",
            "\n",
        )],
        module: None,
        secret: Some(SECRET),
        args: &["--kong", "kong/kong.yml", "kong/kong.conf"],
        lines: &[
            "kong/kong.conf: nginx_wasm_shm_queue: no shm_queue \"zerolayer.jobs.metering\" (metering.observer.queue of filter zerolayer_metering in kong/kong.yml): registering an undeclared queue traps",
        ],
    },
    Case {
        name: "kong.conf without the secret's env",
        edits: &[(
            "kong/kong.conf",
            "nginx_main_env = ZEROLAYER_CACHE_SECRET\n",
            "",
        )],
        module: None,
        secret: Some(SECRET),
        args: &["--kong", "kong/kong-fused.yml", "kong/kong.conf"],
        lines: &[
            "kong/kong.conf: nginx_main_env: \"ZEROLAYER_CACHE_SECRET\" is not declared (post_cache.secret_env of filter zerolayer_fused in kong/kong-fused.yml): nginx clears it from the workers' environment",
        ],
    },
    Case {
        name: "a singleton observer in Kong",
        edits: &[(
            "kong/kong.yml",
            r#""flush_ms":1000},"observer":{"vm_id":"zerolayer","queue":"zerolayer.jobs","mode":"tick"}"#,
            r#""flush_ms":1000},"observer":{"vm_id":"zerolayer","queue":"zerolayer.jobs","mode":"singleton"}"#,
        )],
        module: None,
        secret: Some(SECRET),
        args: &["--kong", "kong/kong.yml", "kong/kong.conf"],
        lines: &[
            "kong/kong.yml: lazy_auth.observer.mode: \"singleton\": Kong has no singleton service; use \"tick\" (in filter zerolayer_lazy_auth)",
        ],
    },
    Case {
        name: "a callout target that is a name in Kong",
        edits: &[(
            "kong/kong.yml",
            r#""cluster":"127.0.0.1:18091""#,
            r#""cluster":"idp""#,
        )],
        module: None,
        secret: Some(SECRET),
        args: &["--kong", "kong/kong.yml", "kong/kong.conf"],
        lines: &[
            "kong/kong.yml: lazy_auth.jwt.jwks.cluster: \"idp\" is not IP:port: ngx_wasm_module calls an address (a name goes to DNS; kong/README.md) (in filter zerolayer_lazy_auth)",
        ],
    },
    Case {
        name: "a fused document with an unknown section",
        edits: &[(
            "kong/kong-fused.yml",
            r#"config: '{"activation":"#,
            r#"config: '{"shadow":{},"activation":"#,
        )],
        module: None,
        secret: Some(SECRET),
        args: &["--kong", "kong/kong-fused.yml", "kong/kong.conf"],
        lines: &[
            "kong/kong-fused.yml: shadow: unknown stage (expected activation, lazy_auth, quota, post_cache, metering) (in filter zerolayer_fused)",
        ],
    },
    Case {
        name: "a bad field in the native section",
        edits: &[(
            "envoy/zerolayer-native.yaml",
            r#""native":{"upstreams":"#,
            r#""native":{"threads":2,"upstreams":"#,
        )],
        module: None,
        secret: Some(SECRET),
        args: &["envoy/zerolayer-native.yaml"],
        lines: &[
            "envoy/zerolayer-native.yaml: native.threads: unknown field `threads`, expected one of …(in http filter zerolayer)",
        ],
    },
    Case {
        name: "no native upstream for a cluster the observer calls",
        edits: &[(
            "envoy/zerolayer-native.yaml",
            r#""idp":"127.0.0.1:18091","#,
            "",
        )],
        module: None,
        secret: Some(SECRET),
        args: &["envoy/zerolayer-native.yaml"],
        lines: &[
            "envoy/zerolayer-native.yaml: native.upstreams: no address for cluster \"idp\" (lazy_auth.jwt.jwks.cluster): the observer's thread calls it directly (in http filter zerolayer)",
        ],
    },
];

/// Whether `line` is `want` (a `…` in `want` standing for any text).
fn matches(want: &str, line: &str) -> bool {
    match want.split_once('…') {
        None => line == want,
        Some((start, end)) => {
            line.len() >= start.len() + end.len() && line.starts_with(start) && line.ends_with(end)
        }
    }
}

#[test]
fn each_broken_configuration_fails_naming_the_file_and_the_field() -> Result<()> {
    assert!(CASES.len() >= 15);
    let mut failures = Vec::new();
    for case in CASES {
        let dir = deployment()?;
        for (file, from, to) in case.edits {
            edit(dir.path(), file, from, to).with_context(|| case.name)?;
        }
        if let Some((module, contents)) = case.module {
            let path = dir.path().join("target/wasm32-wasip1/wasm").join(module);
            match contents {
                None => std::fs::remove_file(path)?,
                Some(bytes) => std::fs::write(path, bytes)?,
            }
        }
        let env: Vec<(&str, &str)> = case
            .secret
            .map(|s| ("ZEROLAYER_CACHE_SECRET", s))
            .into_iter()
            .collect();
        let output = check(dir.path(), case.args, &env)?;
        let out = stdout(&output);
        let lines: Vec<&str> = out.lines().collect();
        let missing: Vec<&&str> = case
            .lines
            .iter()
            .filter(|want| !lines.iter().any(|line| matches(want, line)))
            .collect();
        if output.status.code() != Some(1) || !missing.is_empty() {
            failures.push(format!(
                "{}: exit {:?}, missing {missing:#?}\noutput:\n{out}{}",
                case.name,
                output.status.code(),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    Ok(())
}

#[test]
fn bad_arguments_are_refused() -> Result<()> {
    let dir = deployment()?;
    let output = check(dir.path(), &[], &[])?;
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("no configuration to check"));
    let output = check(dir.path(), &["envoy/none.yaml"], &[])?;
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("reading envoy/none.yaml"));
    Ok(())
}
