// Group-relative advantages, computed as the run's trainer computed them: TRL 1.16's
// GRPOTrainer (multi_objective_aggregation "sum_then_normalize", the only one Trainyard
// uses, with its one reward function) on the run's grpo.scale_rewards:
//
//   A_i = (r_i - mean(group)) / (std + 1e-4)     scale_rewards "group": std of the group
//                                                scale_rewards "batch": std of the step's rewards
//   A_i =  r_i - mean(group)                     scale_rewards "none"
//
// mean and std ignore missing rewards (a dropped group's rollouts, reward null: TRL's NaN,
// nanmean / nanstd); std is the sample standard deviation (Bessel's correction, n - 1), and
// the std of fewer than two rewards is NaN. A rollout without a reward has advantage 0
// (TRL forces unscorable completions to 0), as does any NaN result.

export const EPS = 1e-4;

function finite(values) {
  return values.filter((v) => v !== null && v !== undefined && Number.isFinite(v));
}

export function nanmean(values) {
  const xs = finite(values);
  if (!xs.length) return NaN;
  return xs.reduce((a, b) => a + b, 0) / xs.length;
}

/** Sample standard deviation ignoring missing values (torch-style nanstd, n - 1). */
export function nanstd(values) {
  const xs = finite(values);
  if (xs.length < 2) return NaN;
  const m = nanmean(xs);
  const variance = xs.reduce((a, x) => a + (x - m) ** 2, 0) / (xs.length - 1);
  return Math.sqrt(variance);
}

/**
 * Advantages of one group's rewards (in rollout order).
 * @param {(number|null)[]} group the group's rewards
 * @param {string} scale the run's grpo.scale_rewards: "group" | "batch" | "none"
 * @param {(number|null)[]} stepRewards every reward of the step (for "batch")
 */
export function advantages(group, scale = "group", stepRewards = group) {
  const mean = nanmean(group);
  let std;
  if (scale === "batch") std = nanstd(stepRewards);
  else std = nanstd(group);
  return group.map((r) => {
    if (r === null || r === undefined || !Number.isFinite(r)) return 0;
    const centred = r - mean;
    const a = scale === "none" ? centred : centred / (std + EPS);
    return Number.isFinite(a) ? a : 0;
  });
}
