//! The training example runs on the CPU and its loss falls, under candle's
//! autograd and through `maxsim_value_and_grads`.
#[path = "../examples/train.rs"]
mod train;

#[test]
fn contrastive_training_loss_falls() -> anyhow::Result<()> {
    for scoring in [train::Scoring::Fused, train::Scoring::Grads] {
        let cfg = train::Config { steps: 25, batch: 16, scoring, ..Default::default() };
        let losses = train::run(&cfg, &candle_core::Device::Cpu, false)?;
        let first: f32 = losses[..3].iter().sum::<f32>() / 3.0;
        let last: f32 = losses[losses.len() - 3..].iter().sum::<f32>() / 3.0;
        assert!(losses.iter().all(|l| l.is_finite()));
        assert!(last < 0.7 * first, "{scoring:?}: loss did not fall: {first} -> {last} ({losses:?})");
    }
    Ok(())
}
