//! Plain descriptive statistics and goodness-of-fit tests for the harness.

/// Mean of `xs` (0 for none).
pub fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Unbiased sample variance.
pub fn variance(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return 0.0;
    }
    let m = mean(xs);
    xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (xs.len() - 1) as f64
}

/// Sample excess kurtosis (0 for a normal law); 0 when the variance is 0.
pub fn excess_kurtosis(xs: &[f64]) -> f64 {
    let n = xs.len() as f64;
    let m = mean(xs);
    let m2 = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / n;
    if m2 == 0.0 {
        return 0.0;
    }
    let m4 = xs.iter().map(|x| (x - m).powi(4)).sum::<f64>() / n;
    m4 / (m2 * m2) - 3.0
}

/// Standard deviation of the ratio `sample variance / true variance` over `n` draws of
/// a law with excess kurtosis `kurtosis`: Var(s^2) = sigma^4 (2/(n-1) + kurtosis/n).
pub fn variance_ratio_sd(n: usize, kurtosis: f64) -> f64 {
    let n = n as f64;
    (2.0 / (n - 1.0) + kurtosis.max(0.0) / n).sqrt()
}

/// Pearson correlation of paired samples (0 if either is constant).
pub fn correlation(xs: &[f64], ys: &[f64]) -> f64 {
    let n = xs.len().min(ys.len());
    let (xs, ys) = (&xs[..n], &ys[..n]);
    let (mx, my) = (mean(xs), mean(ys));
    let mut sxy = 0.0;
    let mut sxx = 0.0;
    let mut syy = 0.0;
    for (x, y) in xs.iter().zip(ys) {
        sxy += (x - mx) * (y - my);
        sxx += (x - mx).powi(2);
        syy += (y - my).powi(2);
    }
    if sxx == 0.0 || syy == 0.0 {
        return 0.0;
    }
    sxy / (sxx * syy).sqrt()
}

/// Lag-`k` autocorrelation of a sequence.
pub fn autocorrelation(xs: &[f64], k: usize) -> f64 {
    if xs.len() <= k {
        return 0.0;
    }
    correlation(&xs[..xs.len() - k], &xs[k..])
}

/// Kolmogorov-Smirnov distance between integer draws `values` and `floor(Exp(mean))`,
/// whose CDF at integer x is `1 - exp(-(x + 1)/mean)`.
pub fn ks_distance_floor_exponential(values: &[u64], mean: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let n = sorted.len() as f64;
    let mut d: f64 = 0.0;
    let mut i = 0;
    while i < sorted.len() {
        // Step functions: compare at each distinct value, after all its ties.
        let x = sorted[i];
        let below = i as f64 / n;
        while i < sorted.len() && sorted[i] == x {
            i += 1;
        }
        let at = i as f64 / n;
        let cdf = 1.0 - (-(x as f64 + 1.0) / mean).exp();
        let cdf_before = 1.0 - (-(x as f64) / mean).exp();
        d = d.max((at - cdf).abs()).max((below - cdf_before).abs());
    }
    d
}

/// The Kolmogorov-Smirnov critical distance for `n` draws at significance `alpha`
/// (asymptotic: `sqrt(ln(2/alpha)/2) / sqrt(n)`, from `P(sqrt(n) D > x) <= 2 exp(-2 x^2)`;
/// 1.949 / sqrt(n) at 0.001).
pub fn ks_critical(n: usize, alpha: f64) -> f64 {
    ((2.0 / alpha).ln() / 2.0).sqrt() / (n as f64).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptive_statistics() {
        let xs = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(mean(&xs), 2.5);
        assert!((variance(&xs) - 5.0 / 3.0).abs() < 1e-12);
        assert!((correlation(&xs, &[2.0, 4.0, 6.0, 8.0]) - 1.0).abs() < 1e-12);
        assert!((correlation(&xs, &[8.0, 6.0, 4.0, 2.0]) + 1.0).abs() < 1e-12);
        // Uniform on 4 points: excess kurtosis -1.36.
        assert!((excess_kurtosis(&xs) + 1.36).abs() < 1e-9);
    }

    #[test]
    fn ks_critical_values_match_the_tables() {
        assert!((ks_critical(1, 0.001) - 1.949).abs() < 0.001);
        assert!((ks_critical(1, 1e-6) - 2.693).abs() < 0.001);
    }

    #[test]
    fn ks_detects_a_wrong_mean() {
        let exact: Vec<u64> = (0..10_000)
            .map(|i| (-(1.0 - (i as f64 + 0.5) / 10_000.0).ln() * 1000.0).floor() as u64)
            .collect();
        assert!(ks_distance_floor_exponential(&exact, 1000.0) < 0.002);
        assert!(ks_distance_floor_exponential(&exact, 1100.0) > 0.03);
    }
}
