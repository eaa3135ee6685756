//! Every plan runs to completion on a model of rendezvous communication (a transfer
//! completes only once its peer has posted the matching one), each message reaches the
//! forward or backward that needs it, and the activation bounds hold.

use super::*;
use std::collections::{HashMap, VecDeque};

/// What a message carries: the virtual stage that produced it and the microbatch.
type Payload = (usize, usize);

/// A posted transfer: its channel (sender, receiver), its index there, and whether it is
/// the send.
type Posted = ((usize, usize), usize, bool);

#[derive(Default)]
struct Channel {
    /// Sends posted so far, with the kind and payload of each.
    sends: Vec<(bool, Payload)>,
    /// Receives posted so far: the kind and the payload each expects.
    recvs: Vec<(bool, Payload)>,
}

/// Runs every rank's plan together; panics on a deadlock or a misrouted message.
fn simulate(schedule: Schedule, pp: usize, m: usize) {
    let v = schedule.chunks();
    let plans: Vec<Vec<Action>> = (0..pp).map(|r| schedule.plan(pp, r, m).unwrap()).collect();
    let vstage = |rank: usize, chunk: usize| chunk * pp + rank;
    let last = pp * v - 1;
    let mut channels: HashMap<(usize, usize), Channel> = HashMap::new();
    // Per rank: position, whether the current exchange is posted (and each transfer's
    // channel index), the forwards/backwards still waiting for a received tensor, what
    // has been received, and the latest outputs not yet sent.
    let mut pc = vec![0usize; pp];
    let mut posted: Vec<Option<Vec<Posted>>> = vec![None; pp];
    let mut need_input: Vec<VecDeque<Payload>> = vec![VecDeque::new(); pp];
    let mut need_grad: Vec<VecDeque<Payload>> = vec![VecDeque::new(); pp];
    for (r, plan) in plans.iter().enumerate() {
        for action in plan {
            match *action {
                Action::Forward { chunk, microbatch } if vstage(r, chunk) != 0 => {
                    need_input[r].push_back((vstage(r, chunk), microbatch))
                }
                Action::Backward { chunk, microbatch } if vstage(r, chunk) != last => {
                    need_grad[r].push_back((vstage(r, chunk), microbatch))
                }
                _ => {}
            }
        }
    }
    let mut have_input = vec![Vec::<Payload>::new(); pp];
    let mut have_grad = vec![Vec::<Payload>::new(); pp];
    let mut forwarded = vec![Vec::<Payload>::new(); pp];
    let mut out_fwd: Vec<Option<Payload>> = vec![None; pp];
    let mut out_bwd: Vec<Option<Payload>> = vec![None; pp];
    let context = format!("{} pp={pp} m={m} v={v}", schedule.name());
    loop {
        let mut progressed = false;
        for r in 0..pp {
            let Some(action) = plans[r].get(pc[r]) else {
                continue;
            };
            match action {
                Action::Forward { chunk, microbatch } => {
                    let me = (vstage(r, *chunk), *microbatch);
                    if me.0 != 0 {
                        let at = have_input[r].iter().position(|p| *p == me);
                        let at = at.unwrap_or_else(|| {
                            panic!("{context}: rank {r} runs F{me:?} without its input")
                        });
                        have_input[r].remove(at);
                    }
                    forwarded[r].push(me);
                    assert!(
                        out_fwd[r].is_none() || me.0 == last,
                        "{context}: rank {r} overwrote an unsent activation"
                    );
                    out_fwd[r] = (me.0 != last).then_some(me);
                    pc[r] += 1;
                    progressed = true;
                }
                Action::Backward { chunk, microbatch } => {
                    let me = (vstage(r, *chunk), *microbatch);
                    assert!(
                        forwarded[r].contains(&me),
                        "{context}: rank {r} runs B{me:?} before F"
                    );
                    if me.0 != last {
                        let at = have_grad[r].iter().position(|p| *p == me);
                        let at = at.unwrap_or_else(|| {
                            panic!("{context}: rank {r} runs B{me:?} without its gradient")
                        });
                        have_grad[r].remove(at);
                    }
                    assert!(
                        out_bwd[r].is_none(),
                        "{context}: rank {r} overwrote an unsent gradient"
                    );
                    out_bwd[r] = (me.0 != 0).then_some(me);
                    pc[r] += 1;
                    progressed = true;
                }
                Action::Exchange(transfers) => {
                    if posted[r].is_none() {
                        let mut mine = Vec::new();
                        for t in transfers {
                            let (peer, send, kind, payload) = match t {
                                Transfer::SendForward => {
                                    let p = out_fwd[r].take().unwrap_or_else(|| {
                                        panic!("{context}: rank {r} sends no activation")
                                    });
                                    ((r + 1) % pp, true, true, p)
                                }
                                Transfer::SendBackward => {
                                    let p = out_bwd[r].take().unwrap_or_else(|| {
                                        panic!("{context}: rank {r} sends no gradient")
                                    });
                                    ((r + pp - 1) % pp, true, false, p)
                                }
                                Transfer::RecvForward => {
                                    let p = need_input[r].pop_front().unwrap_or_else(|| panic!("{context}: rank {r} receives an activation nobody needs"));
                                    ((r + pp - 1) % pp, false, true, (p.0 - 1, p.1))
                                }
                                Transfer::RecvBackward => {
                                    let p = need_grad[r].pop_front().unwrap_or_else(|| {
                                        panic!(
                                            "{context}: rank {r} receives a gradient nobody needs"
                                        )
                                    });
                                    ((r + 1) % pp, false, false, (p.0 + 1, p.1))
                                }
                            };
                            let key = if send { (r, peer) } else { (peer, r) };
                            let channel = channels.entry(key).or_default();
                            let list = if send {
                                &mut channel.sends
                            } else {
                                &mut channel.recvs
                            };
                            list.push((kind, payload));
                            mine.push((key, list.len() - 1, send));
                        }
                        posted[r] = Some(mine);
                        progressed = true;
                    }
                    let done = posted[r].as_ref().unwrap().iter().all(|&(key, i, send)| {
                        let c = &channels[&key];
                        if send {
                            c.recvs.len() > i
                        } else {
                            c.sends.len() > i
                        }
                    });
                    if done {
                        for &(key, i, send) in posted[r].as_ref().unwrap() {
                            let c = &channels[&key];
                            assert_eq!(
                                c.sends[i], c.recvs[i],
                                "{context}: message {i} from rank {} to rank {} is misrouted",
                                key.0, key.1
                            );
                            if !send {
                                let (kind, (from, mb)) = c.recvs[i];
                                if kind {
                                    have_input[r].push((from + 1, mb));
                                } else {
                                    have_grad[r].push((from - 1, mb));
                                }
                            }
                        }
                        posted[r] = None;
                        pc[r] += 1;
                        progressed = true;
                    }
                }
            }
        }
        if (0..pp).all(|r| pc[r] == plans[r].len()) {
            break;
        }
        assert!(
            progressed,
            "{context}: deadlock at {:?}",
            (0..pp).map(|r| plans[r].get(pc[r])).collect::<Vec<_>>()
        );
    }
    for r in 0..pp {
        let mut done = forwarded[r].clone();
        done.sort_unstable();
        let mut expected: Vec<Payload> = (0..v)
            .flat_map(|c| (0..m).map(move |mb| (vstage(r, c), mb)))
            .collect();
        expected.sort_unstable();
        assert_eq!(done, expected, "{context}: rank {r} forwards");
        assert!(
            out_fwd[r].is_none() && out_bwd[r].is_none(),
            "{context}: rank {r} left a tensor unsent"
        );
    }
    for (key, c) in &channels {
        assert_eq!(c.sends.len(), c.recvs.len(), "{context}: channel {key:?}");
    }
}

#[test]
fn every_plan_completes_and_routes_each_message_to_its_consumer() {
    for pp in 1..=5 {
        for m in 1..=10 {
            simulate(Schedule::GPipe, pp, m);
            simulate(Schedule::OneFOneB, pp, m);
            for virtual_stages in 1..=3 {
                if m % pp == 0 && (pp > 1 || virtual_stages == 1) {
                    simulate(Schedule::Interleaved { virtual_stages }, pp, m);
                }
            }
        }
    }
}

#[test]
fn activations_in_flight_stay_within_each_schedules_bound() {
    for pp in 1..=5 {
        for m in 1..=10 {
            for rank in 0..pp {
                let gpipe = Schedule::GPipe.plan(pp, rank, m).unwrap();
                assert_eq!(peak_in_flight(&gpipe), m);
                let one = Schedule::OneFOneB.plan(pp, rank, m).unwrap();
                assert_eq!(
                    peak_in_flight(&one),
                    (pp - rank).min(m),
                    "pp={pp} m={m} rank={rank}"
                );
            }
        }
    }
    // Interleaved: Megatron's warm-up, 2·(pp − rank − 1) + (v − 1)·pp forwards, plus one.
    let (pp, v, m) = (4, 2, 8);
    for rank in 0..pp {
        let plan = Schedule::Interleaved { virtual_stages: v }
            .plan(pp, rank, m)
            .unwrap();
        assert_eq!(
            peak_in_flight(&plan),
            2 * (pp - rank - 1) + (v - 1) * pp + 1
        );
    }
}

#[test]
fn the_one_f_one_b_plan_of_a_middle_stage_reads_like_megatrons() {
    use Action::{Backward as B, Exchange as X, Forward as F};
    use Transfer::*;
    // pp = 3, stage 1, 3 microbatches: one warm-up forward, two 1F1B pairs, one cool-down.
    let plan = Schedule::OneFOneB.plan(3, 1, 3).unwrap();
    let f = |microbatch| F {
        chunk: 0,
        microbatch,
    };
    let b = |microbatch| B {
        chunk: 0,
        microbatch,
    };
    assert_eq!(
        plan,
        vec![
            X(vec![RecvForward]),
            f(0),
            X(vec![SendForward, RecvForward]),
            f(1),
            X(vec![SendForward, RecvBackward]),
            b(0),
            X(vec![SendBackward, RecvForward]),
            f(2),
            X(vec![SendForward, RecvBackward]),
            b(1),
            X(vec![SendBackward, RecvBackward]),
            b(2),
            X(vec![SendBackward]),
        ]
    );
}

#[test]
fn bad_microbatch_counts_and_names_are_errors() {
    let err = Schedule::Interleaved { virtual_stages: 2 }
        .plan(4, 0, 6)
        .unwrap_err();
    assert!(err.to_string().contains("not a multiple of 4"), "{err}");
    assert!(err.to_string().contains("use 4 or 8"), "{err}");
    assert!(Schedule::GPipe.plan(2, 0, 0).is_err());
    assert!(Schedule::OneFOneB.plan(2, 2, 4).is_err());
    assert!(Schedule::Interleaved { virtual_stages: 0 }
        .plan(2, 0, 2)
        .is_err());
    assert!(Schedule::Interleaved { virtual_stages: 2 }
        .plan(1, 0, 2)
        .is_err());
    assert!(Schedule::from_name("zero-bubble", 1).is_err());
    for name in ["gpipe", "1f1b", "interleaved"] {
        assert_eq!(Schedule::from_name(name, 2).unwrap().name(), name);
    }
}

#[test]
fn theory_matches_the_papers_formulas() {
    assert_eq!(Schedule::GPipe.bubble_fraction(4, 8), 3.0 / 11.0);
    assert_eq!(Schedule::OneFOneB.bubble_fraction(4, 8), 3.0 / 11.0);
    let interleaved = Schedule::Interleaved { virtual_stages: 2 };
    assert_eq!(interleaved.bubble_fraction(4, 8), 3.0 / 19.0);
    assert_eq!(Schedule::OneFOneB.bubble_fraction(1, 8), 0.0);
}
