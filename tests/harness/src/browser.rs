//! A real browser for the HTML report's tests and benchmark: Debian's Chromium,
//! headless, driven through chromedriver's WebDriver protocol (plain HTTP on
//! localhost). Only what the tests need: open a page, run a script in it, click, type,
//! read the console, take a screenshot.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::net::free_port;
use base64::Engine as _;
use serde_json::{json, Value};

/// Debian's chromium and its driver (`chromium`, `chromium-driver`).
pub const CHROMIUM: &str = "/usr/bin/chromium";
/// chromedriver, as Debian installs it.
pub const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// WebDriver's key of an element reference.
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";
/// How long chromedriver may take to listen, and a page to draw.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A headless Chromium session; the driver and browser end with it.
pub struct Browser {
    driver: Child,
    base: String,
    session: String,
    profile: PathBuf,
}

/// Whether the browser can run here (its packages are installed).
pub fn available() -> bool {
    Path::new(CHROMIUM).exists() && Path::new(CHROMEDRIVER).exists()
}

impl Browser {
    /// Starts chromedriver and a headless Chromium with a fresh profile and a
    /// `width`×`height` window.
    pub fn start(width: u32, height: u32) -> Result<Browser> {
        if !available() {
            bail!("{CHROMIUM} or {CHROMEDRIVER} is missing: `cargo xtask setup` installs Debian's chromium and chromium-driver");
        }
        let port = free_port()?;
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting chromedriver")?;
        let profile =
            std::env::temp_dir().join(format!("allocbpf-chromium-{}-{port}", std::process::id()));
        let mut browser = Browser {
            driver,
            base: format!("http://127.0.0.1:{port}"),
            session: String::new(),
            profile,
        };
        let started = Instant::now();
        while ureq::get(&format!("{}/status", browser.base))
            .call()
            .is_err()
        {
            if started.elapsed() > START_TIMEOUT {
                bail!("chromedriver did not listen on port {port} within {START_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu",
                    "--disable-dev-shm-usage", "--no-first-run",
                    format!("--window-size={width},{height}"),
                    format!("--user-data-dir={}", browser.profile.display()),
                ],
            },
            "goog:loggingPrefs": {"browser": "ALL"},
        }}});
        let created = browser.post("/session", &capabilities)?;
        browser.session = created["sessionId"]
            .as_str()
            .context("chromedriver gave no session id")?
            .to_string();
        Ok(browser)
    }

    fn post(&self, path: &str, body: &Value) -> Result<Value> {
        let url = format!("{}{path}", self.base);
        let response = match ureq::post(&url).send_json(body.clone()) {
            Ok(response) => response,
            Err(ureq::Error::Status(code, response)) => {
                let text = response.into_string().unwrap_or_default();
                bail!("WebDriver {path}: HTTP {code}: {text}");
            }
            Err(error) => return Err(error).with_context(|| format!("WebDriver {path}")),
        };
        let value: Value = response.into_json()?;
        Ok(value["value"].clone())
    }

    fn get(&self, path: &str) -> Result<Value> {
        let url = format!("{}{path}", self.base);
        let value: Value = ureq::get(&url)
            .call()
            .with_context(|| format!("WebDriver {path}"))?
            .into_json()?;
        Ok(value["value"].clone())
    }

    fn session_path(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    /// Opens `page` (a file) and waits until its script says it is drawn
    /// (`window.allocbpf.drawnAt`).
    pub fn open(&self, page: &Path) -> Result<()> {
        let url = format!("file://{}", page.canonicalize()?.display());
        self.post(&self.session_path("/url"), &json!({"url": url}))?;
        let started = Instant::now();
        loop {
            if self.script("return !!(window.allocbpf && window.allocbpf.drawnAt)")? == json!(true)
            {
                return Ok(());
            }
            if started.elapsed() > START_TIMEOUT {
                bail!("{} was not drawn within {START_TIMEOUT:?}", page.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `body` (a function body: `return ...`) in the page, returns its value.
    pub fn script(&self, body: &str) -> Result<Value> {
        self.post(
            &self.session_path("/execute/sync"),
            &json!({"script": body, "args": []}),
        )
    }

    fn element(&self, css: &str) -> Result<String> {
        let found = self.post(
            &self.session_path("/element"),
            &json!({"using": "css selector", "value": css}),
        )?;
        Ok(found[ELEMENT_KEY]
            .as_str()
            .with_context(|| format!("no element {css}"))?
            .to_string())
    }

    /// Clicks the element `css` selects, as a user would (WebDriver moves the pointer
    /// there and clicks).
    pub fn click(&self, css: &str) -> Result<()> {
        let id = self.element(css)?;
        self.post(
            &self.session_path(&format!("/element/{id}/click")),
            &json!({}),
        )?;
        Ok(())
    }

    /// Moves the pointer to (`x`, `y`) in the viewport, as a user would, and clicks
    /// there if `click`.
    pub fn pointer_at(&self, x: f64, y: f64, click: bool) -> Result<()> {
        let mut actions = vec![
            json!({"type": "pointerMove", "duration": 0, "origin": "viewport",
            "x": x.round() as i64, "y": y.round() as i64}),
        ];
        if click {
            actions.push(json!({"type": "pointerDown", "button": 0}));
            actions.push(json!({"type": "pointerUp", "button": 0}));
        }
        self.post(
            &self.session_path("/actions"),
            &json!({"actions": [{"type": "pointer", "id": "mouse",
                "parameters": {"pointerType": "mouse"}, "actions": actions}]}),
        )?;
        Ok(())
    }

    /// Types `text` into the element `css` selects.
    pub fn type_into(&self, css: &str, text: &str) -> Result<()> {
        let id = self.element(css)?;
        self.post(
            &self.session_path(&format!("/element/{id}/value")),
            &json!({"text": text}),
        )?;
        Ok(())
    }

    /// The browser console's entries since the last call: (level, message).
    pub fn console(&self) -> Result<Vec<(String, String)>> {
        let entries = self.post(&self.session_path("/se/log"), &json!({"type": "browser"}))?;
        Ok(entries
            .as_array()
            .map(|list| {
                list.iter()
                    .map(|e| {
                        (
                            e["level"].as_str().unwrap_or("").to_string(),
                            e["message"].as_str().unwrap_or("").to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Saves a PNG screenshot of the window to `path`.
    pub fn screenshot(&self, path: &Path) -> Result<()> {
        let encoded = self.get(&self.session_path("/screenshot"))?;
        let png = base64::engine::general_purpose::STANDARD
            .decode(encoded.as_str().context("no screenshot")?)
            .context("decoding the screenshot")?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, png).with_context(|| format!("writing {}", path.display()))
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let url = format!("{}{}", self.base, self.session_path(""));
            let _ = ureq::delete(&url).call();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}
