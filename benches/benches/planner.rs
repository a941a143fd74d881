//! Plan time of the `teraio` and `auto` policies, the lower bound and the simulator on the
//! paper's presets.
//!
//! `cargo bench -p teraio-benches --bench planner`
#![expect(missing_docs, reason = "criterion_group! generates an undocumented pub fn")]

use criterion::{Criterion, criterion_group, criterion_main};
use teraio_scheduler::{
    Hardware, ModelConfig, Policy, SimOptions, generate, lower_bound, plan, simulate,
};

fn planner(c: &mut Criterion) {
    let hw = Hardware::paper();
    let mut group = c.benchmark_group("plan");
    group.sample_size(10);
    for name in ["llama3-8b", "llama3-70b"] {
        let trace = generate(&ModelConfig::preset(name).expect("preset")).expect("trace");
        group.bench_function(format!("teraio/{name}"), |b| {
            b.iter(|| plan(&trace, &hw, Policy::Teraio).expect("plan"))
        });
        group.bench_function(format!("auto/{name}"), |b| {
            b.iter(|| plan(&trace, &hw, Policy::Auto).expect("plan"))
        });
        group.bench_function(format!("lower-bound/{name}"), |b| {
            b.iter(|| lower_bound(&trace, &hw).expect("bound"))
        });
        let p = plan(&trace, &hw, Policy::Teraio).expect("plan");
        group.bench_function(format!("simulate/{name}"), |b| {
            b.iter(|| simulate(&trace, &p, &hw, &SimOptions::default()).expect("simulate"))
        });
    }
    group.finish();
}

criterion_group!(benches, planner);
criterion_main!(benches);
