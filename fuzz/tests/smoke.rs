//! CI's fuzz smoke: every target on a short budget (the long runs are in
//! docs/reliability.md). Prints executions and crashes per target.

#[test]
fn every_target_survives_a_short_budget() {
    accel_fuzz::count_panics();
    let mut total = 0;
    for (name, f) in accel_fuzz::TARGETS {
        let runs = if name == "vhost_user" { 3_000 } else { 50_000 };
        let r = accel_fuzz::run_target(name, f, runs, 42, 4096, None);
        println!(
            "fuzz {name}: {} executions, {} crashes, {:.1} s",
            r.executions, r.crashes, r.secs
        );
        assert_eq!(r.crashes, 0, "{name} crashed");
        total += r.executions;
    }
    assert!(total > 200_000);
}
