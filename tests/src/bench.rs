//! What the load benches share (`envoy_load`, `kong_load`, `peers`): a
//! process tree's CPU time from `/proc`, pinning it to a CPU, and the
//! median over rounds.

use std::process::{Command, Stdio};

use anyhow::{Result, anyhow, bail};

/// `pid` and its descendants.
pub fn tree(pid: u32) -> Vec<u32> {
    let mut all = vec![pid];
    let mut i = 0;
    while let Some(&p) = all.get(i) {
        all.extend(crate::ngx::children(p));
        i += 1;
    }
    all
}

/// User + system CPU seconds of `pid` and its descendants (every thread,
/// ended ones included); an error once `pid` itself has exited.
pub fn tree_cpu_secs(pid: u32) -> Result<f64> {
    let mut total = 0;
    for p in tree(pid) {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            // Gone since the listing: its time went with it.
            continue;
        };
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .ok_or_else(|| anyhow!("unparsable /proc/{p}/stat"))?;
        // After "(comm)": state is field 0, utime 11, stime 12.
        let field = |i: usize| -> Result<u64> {
            Ok(fields
                .get(i)
                .ok_or_else(|| anyhow!("short /proc/{p}/stat"))?
                .parse()?)
        };
        total += field(11)? + field(12)?;
    }
    if std::fs::metadata(format!("/proc/{pid}")).is_err() {
        bail!("process {pid} exited");
    }
    Ok(total as f64 / clock_ticks())
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 on Linux).
fn clock_ticks() -> f64 {
    command_output("getconf", &["CLK_TCK"])
        .and_then(|s| s.parse().ok())
        .unwrap_or(100.0)
}

/// Pins every thread of `pid` to `cpu`.
pub fn pin(pid: u32, cpu: u32) -> bool {
    Command::new("taskset")
        .args(["-a", "-p", "-c", &cpu.to_string(), &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Pins `pid`, its descendants and all their threads to `cpu`.
pub fn pin_tree(pid: u32, cpu: u32) -> bool {
    tree(pid).into_iter().all(|p| pin(p, cpu))
}

/// Pins this process (and what it starts after) to `cpu`, on a machine
/// with two CPUs or more; whether it did.
pub fn pin_self(cpu: u32) -> bool {
    cpus() >= 2 && pin(std::process::id(), cpu)
}

/// CPUs this process may use.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// The load average over 1, 5 and 15 minutes (`?` where unreadable), for
/// the record of what else the machine was doing.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// What `program args` printed, trimmed, if it ran and succeeded.
pub fn command_output(program: &str, args: &[&str]) -> Option<String> {
    let output = Command::new(program).args(args).output().ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// The median (`NaN` for none; the mean of the middle two for an even count).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_this_process_cpu() {
        assert!(median(vec![]).is_nan());
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(tree_cpu_secs(std::process::id()).unwrap() >= 0.0);
        assert!(tree(std::process::id()).contains(&std::process::id()));
    }
}
