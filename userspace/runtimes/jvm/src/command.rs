//! What a `java` command line names as the program: its main class, its jar, or its
//! module's main class, for the `java_main` label (every JVM's command name is `java`,
//! so services are told apart by this). The command line is the process's own and
//! read as hostile input: at most [`MAX_CMDLINE`] bytes, a name of at most
//! [`MAX_MAIN`] printable characters.

use std::io::Read;

/// Bytes of `/proc/PID/cmdline` read at most.
pub const MAX_CMDLINE: u64 = 64 << 10;

/// Longest name kept.
pub const MAX_MAIN: usize = 256;

/// The launcher's options that take their value as the next argument.
const WITH_VALUE: &[&str] = &[
    "-cp",
    "-classpath",
    "--class-path",
    "-p",
    "--module-path",
    "--upgrade-module-path",
    "--add-modules",
    "--enable-native-access",
    "--limit-modules",
    "--add-reads",
    "--add-exports",
    "--add-opens",
    "--patch-module",
    "--source",
];

/// `pid`'s main class or jar, from its command line.
pub fn main_of_process(pid: u32) -> Option<String> {
    let file = std::fs::File::open(format!("/proc/{pid}/cmdline")).ok()?;
    let mut bytes = Vec::new();
    file.take(MAX_CMDLINE).read_to_end(&mut bytes).ok()?;
    main_of(&bytes)
}

/// The main class or jar a NUL-separated `java` command line names: `-jar app.jar`
/// names `app.jar`, `-m module/pkg.Main` names `pkg.Main`, else the first argument
/// after the launcher's options.
pub fn main_of(cmdline: &[u8]) -> Option<String> {
    let mut args = cmdline
        .split(|&b| b == 0)
        .skip(1)
        .map(|arg| String::from_utf8_lossy(arg).into_owned());
    while let Some(arg) = args.next() {
        let name = match arg.as_str() {
            "-jar" => {
                let jar = args.next()?;
                jar.rsplit('/').next().unwrap_or(&jar).to_string()
            }
            "-m" | "--module" => {
                let module = args.next()?;
                module.rsplit('/').next().unwrap_or(&module).to_string()
            }
            option if WITH_VALUE.contains(&option) => {
                args.next()?;
                continue;
            }
            option if option.starts_with('-') => continue,
            main => main.to_string(),
        };
        return clean(&name);
    }
    None
}

/// `name` if it is printable and not empty, cut at [`MAX_MAIN`] characters.
fn clean(name: &str) -> Option<String> {
    let name: String = name.chars().take(MAX_MAIN).collect();
    (!name.is_empty() && !name.contains(|c: char| c.is_control())).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(args: &[&str]) -> Vec<u8> {
        args.join("\0").into_bytes()
    }

    #[test]
    fn main_classes_jars_and_modules_are_named() {
        let cases: &[(&[&str], Option<&str>)] = &[
            (
                &["java", "-cp", "/tmp/ws", "AllocSites", "400"],
                Some("AllocSites"),
            ),
            (
                &["java", "-Xmx1g", "-jar", "/srv/app/orders.jar", "--port=1"],
                Some("orders.jar"),
            ),
            (
                &["java", "-Dx=y", "-m", "app.mod/app.Main"],
                Some("app.Main"),
            ),
            (
                &[
                    "java",
                    "--class-path",
                    "a:b",
                    "-XX:+UseG1GC",
                    "kafka.Kafka",
                    "cfg",
                ],
                Some("kafka.Kafka"),
            ),
            (&["java", "-version"], None),
            (&["java", "-jar"], None),
            (&["java", "bad\u{7}name"], None),
        ];
        for (args, expected) in cases {
            assert_eq!(main_of(&line(args)).as_deref(), *expected, "{args:?}");
        }
        let long = "x".repeat(10_000);
        assert_eq!(main_of(&line(&["java", &long])).unwrap().len(), MAX_MAIN);
    }
}
