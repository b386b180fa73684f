//! What a runtime's workload says of itself (the JVM's, Node.js's): lines `site NAME
//! COUNT BYTES_EACH` and `KEY VALUE`.

use anyhow::Result;

/// The value of the workload's output line `key VALUE`.
pub fn output_value(output: &str, key: &str) -> Option<f64> {
    output.lines().find_map(|line| {
        let (name, value) = line.split_once(' ')?;
        (name == key).then(|| value.trim().parse().ok()).flatten()
    })
}

/// What a workload printed of one site: objects and bytes each.
#[derive(Debug)]
pub struct Site {
    /// The site's name (`smallArray`, `pointA`...).
    pub name: String,
    /// Objects it allocated.
    pub count: f64,
    /// Bytes each took.
    pub bytes_each: f64,
}

impl Site {
    /// Its bytes.
    pub fn bytes(&self) -> f64 {
        self.count * self.bytes_each
    }
}

/// The workload's `site NAME COUNT BYTES_EACH` lines, in order.
pub fn parse_sites(output: &str) -> Result<Vec<Site>> {
    let mut sites = Vec::new();
    for line in output.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if let ["site", name, count, each] = fields.as_slice() {
            sites.push(Site {
                name: name.to_string(),
                count: count.parse()?,
                bytes_each: each.parse()?,
            });
        }
    }
    Ok(sites)
}
