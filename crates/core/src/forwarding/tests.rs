//! The forwarding sysctl decisions: a value goes back only when tunnelgate changed it and no
//! running daemon of the namespace still needs it; a simulation of daemons starting, stopping
//! and being killed never turns forwarding off under a running daemon and, once every daemon
//! has stopped, leaves each sysctl as it found it.

use super::*;
use proptest::prelude::*;

const NS: &str = "net:[4026531840]";
/// The cookie of the namespace `NS` names in these tests.
const COOKIE: u64 = 4096;

fn writer(pid: u32) -> Writer {
    Writer {
        pid,
        start_ticks: u64::from(pid) * 10,
        netns: NS.into(),
        netns_cookie: Some(COOKIE),
    }
}

fn set(families: &[Family]) -> BTreeSet<Family> {
    families.iter().copied().collect()
}

fn record(pid: u32, needed: &[Family], changed: &[Family]) -> ForwardingRecord {
    ForwardingRecord {
        writer: writer(pid),
        needed: set(needed),
        changed: set(changed),
    }
}

fn other(interface: &str, record: ForwardingRecord, alive: bool) -> OtherRecord {
    OtherRecord {
        interface: interface.into(),
        record,
        alive,
    }
}

use Family::{V4, V6};

#[test]
fn alone_it_puts_back_only_what_it_changed() {
    let plan = on_stop(&record(1, &[V4, V6], &[V4]), &[]);
    assert_eq!(plan.restore, set(&[V4]), "ipv6 was on before: left on");
    assert_eq!(plan.own, None, "nothing left to record");
}

#[test]
fn a_change_another_running_daemon_needs_is_left_on_and_recorded() {
    let b = other("tg-b", record(2, &[V4], &[]), true);
    let plan = on_stop(&record(1, &[V4], &[V4]), std::slice::from_ref(&b));
    assert!(plan.restore.is_empty());
    assert_eq!(
        plan.own,
        Some(record(1, &[], &[V4])),
        "the change is left for tg-b"
    );
    assert!(
        plan.others.is_empty(),
        "a running daemon's record is its own"
    );

    // tg-b stops later (tg-a's process is gone by then): it puts the value back and removes
    // tg-a's record.
    let a_left = other("tg-a", record(1, &[], &[V4]), false);
    let plan = on_stop(&b.record, &[a_left]);
    assert_eq!(plan.restore, set(&[V4]));
    assert_eq!(plan.own, None);
    assert_eq!(plan.others, BTreeMap::from([("tg-a".to_string(), None)]));
}

#[test]
fn families_are_decided_separately() {
    let b = other("tg-b", record(2, &[V6], &[]), true);
    let plan = on_stop(&record(1, &[V4, V6], &[V4, V6]), &[b]);
    assert_eq!(plan.restore, set(&[V4]));
    assert_eq!(plan.own, Some(record(1, &[], &[V6])));
}

#[test]
fn a_family_given_up_on_reload_goes_back_as_at_stop_and_the_rest_stays() {
    let plan = on_release(&record(1, &[V4, V6], &[V4, V6]), &set(&[V6]), &[]);
    assert_eq!(plan.restore, set(&[V6]), "ipv6 is no longer needed");
    assert_eq!(
        plan.own,
        Some(record(1, &[V4], &[V4])),
        "ipv4 is still needed: on, and still ours to put back at stop"
    );

    // Giving up everything is a stop.
    let own = record(1, &[V4, V6], &[V4]);
    let b = other("tg-b", record(2, &[V4], &[]), true);
    let released = on_release(&own, &set(&[V4, V6]), std::slice::from_ref(&b));
    assert_eq!(released, on_stop(&own, &[b]));
    assert_eq!(
        released.own,
        Some(record(1, &[], &[V4])),
        "tg-b still needs ipv4"
    );
}

/// tg-a stopped and left its ipv6 change for tg-b; tg-b was killed and came back needing only
/// ipv4; a reload to no forwarding at all removes its record, so this is the last chance to put
/// ipv6 back (found by the simulation below).
#[test]
fn a_reload_that_gives_up_everything_also_puts_back_a_dead_daemons_change() {
    let a = other("tg-a", record(1, &[], &[V6]), false);
    let plan = on_release(
        &record(3, &[V4], &[V4]),
        &set(&[V4]),
        std::slice::from_ref(&a),
    );
    assert_eq!(plan.restore, set(&[V4, V6]));
    assert_eq!(plan.own, None);
    assert_eq!(
        plan.others,
        BTreeMap::from([("tg-a".to_string(), None)]),
        "its change is put back: nothing left to record"
    );

    // A running daemon that needs ipv6 keeps it on; so does this one while it still needs it.
    let b = other("tg-b", record(2, &[V6], &[]), true);
    let plan = on_release(&record(3, &[V4], &[V4]), &set(&[V4]), &[a.clone(), b]);
    assert_eq!(plan.restore, set(&[V4]));
    let plan = on_release(&record(3, &[V4, V6], &[V4]), &set(&[V4]), &[a]);
    assert_eq!(plan.restore, set(&[V4]));
}

#[test]
fn releasing_a_family_it_neither_needed_nor_changed_changes_nothing() {
    let own = record(1, &[V4], &[V4]);
    let plan = on_release(&own, &set(&[V6]), &[]);
    assert!(plan.restore.is_empty());
    assert_eq!(plan.own, Some(own));
}

#[test]
fn dead_daemons_need_nothing_and_their_records_are_cleaned() {
    let stale = other("tg-old", record(7, &[V4], &[]), false);
    let plan = on_stop(&record(1, &[V4], &[V4]), &[stale]);
    assert_eq!(
        plan.restore,
        set(&[V4]),
        "a dead daemon does not keep forwarding on"
    );
    assert_eq!(plan.others, BTreeMap::from([("tg-old".to_string(), None)]));
}

#[test]
fn a_change_of_a_killed_daemon_is_put_back_by_the_last_one() {
    let killed = other("tg-k", record(7, &[V4], &[V4]), false);
    let plan = on_stop(&record(1, &[V4], &[]), &[killed]);
    assert_eq!(plan.restore, set(&[V4]));
    assert_eq!(plan.others, BTreeMap::from([("tg-k".to_string(), None)]));
}

#[test]
fn another_namespace_is_neither_counted_nor_touched() {
    let mut elsewhere = record(2, &[V4], &[V4]);
    elsewhere.writer.netns = "net:[4026532999]".into();
    let dead_elsewhere = other("tg-x", elsewhere.clone(), false);
    let live_elsewhere = other("tg-y", elsewhere, true);
    let plan = on_stop(&record(1, &[V4], &[V4]), &[dead_elsewhere, live_elsewhere]);
    assert_eq!(
        plan.restore,
        set(&[V4]),
        "tg-y needs ipv4 in its own namespace only"
    );
    assert!(plan.others.is_empty());
    let plan = on_stop(
        &record(1, &[V4], &[]),
        &[other(
            "tg-x",
            {
                let mut r = record(2, &[], &[V4]);
                r.writer.netns = "net:[4026532999]".into();
                r
            },
            false,
        )],
    );
    assert!(
        plan.restore.is_empty(),
        "another namespace's change is not ours to undo"
    );
}

#[test]
fn a_restart_after_kill_inherits_the_change() {
    // Run 1 turned ipv4 on and was killed with -9; run 2 finds it on already.
    let previous = other("tg0", record(1, &[V4], &[V4]), false);
    let rec = on_enable(&writer(2), Some(&previous), &set(&[V4]), &BTreeSet::new());
    assert_eq!(rec, record(2, &[V4], &[V4]));
    assert_eq!(on_stop(&rec, &[]).restore, set(&[V4]));
}

#[test]
fn a_record_is_inherited_only_from_a_dead_run_of_this_namespace() {
    let mut foreign = record(1, &[V4], &[V4]);
    foreign.writer.netns = "net:[4026532999]".into();
    let rec = on_enable(
        &writer(2),
        Some(&other("tg0", foreign, false)),
        &set(&[V4]),
        &BTreeSet::new(),
    );
    assert_eq!(rec.changed, BTreeSet::new());
    // Our own earlier write in this run (a second EnableForwarding) is extended.
    let first = other("tg0", record(2, &[V4], &[V4]), true);
    let rec = on_enable(&writer(2), Some(&first), &set(&[V6]), &set(&[V6]));
    assert_eq!(rec, record(2, &[V4, V6], &[V4, V6]));
}

/// A record written in a namespace that has ended, read in a new namespace the kernel gave the
/// same inode number: the cookie tells them apart.
fn from_a_namespace_that_ended(
    pid: u32,
    needed: &[Family],
    changed: &[Family],
) -> ForwardingRecord {
    let mut rec = record(pid, needed, changed);
    rec.writer.netns_cookie = Some(COOKIE - 1);
    rec
}

#[test]
fn a_record_is_live_its_writer_gone_or_its_namespace_gone() {
    let me = writer(2);
    assert_eq!(standing(&me, &record(1, &[V4], &[]), true), Standing::Live);
    assert_eq!(
        standing(&me, &record(1, &[V4], &[V4]), false),
        Standing::WriterGone,
        "killed with -9 in this namespace: its change is ours to put back"
    );
    let ended = from_a_namespace_that_ended(1, &[V4], &[V4]);
    assert_eq!(standing(&me, &ended, false), Standing::NamespaceGone);
    assert_eq!(
        standing(&me, &ended, true),
        Standing::NamespaceGone,
        "its namespace ended, so whatever runs under that pid is not its writer"
    );
    let mut elsewhere = record(1, &[V4], &[V4]);
    elsewhere.writer.netns = "net:[4026532999]".into();
    elsewhere.writer.netns_cookie = Some(COOKIE + 1);
    assert_eq!(
        standing(&me, &elsewhere, false),
        Standing::WriterGone,
        "another namespace's: left for that namespace"
    );
    // Without a cookie on either side (an older version, a kernel before 5.14), the inode
    // number is all there is: the same namespace.
    let mut old = record(1, &[V4], &[V4]);
    old.writer.netns_cookie = None;
    assert_eq!(standing(&me, &old, false), Standing::WriterGone);
    assert!(old.writer.same_namespace(&me) && me.same_namespace(&old.writer));
}

#[test]
fn a_record_of_a_namespace_that_ended_is_neither_inherited_nor_counted() {
    // The trap: an admin turned forwarding on in a new namespace, whose inode number a dead
    // daemon's record names with `changed`. Taken as ours, our stop would turn it off.
    let ended = other("tg0", from_a_namespace_that_ended(1, &[V4], &[V4]), false);
    let rec = on_enable(&writer(2), Some(&ended), &set(&[V4]), &BTreeSet::new());
    assert_eq!(rec, record(2, &[V4], &[]), "nothing inherited");
    let plan = on_stop(&rec, std::slice::from_ref(&ended));
    assert!(plan.restore.is_empty(), "{plan:?}");
    assert!(
        plan.others.is_empty(),
        "another namespace's record: not ours to rewrite"
    );
    // Nor does a live daemon of the ended namespace keep ours on (it cannot exist, but its
    // record must not count).
    let phantom = other("tg1", from_a_namespace_that_ended(3, &[V4], &[]), true);
    let plan = on_stop(&record(2, &[V4], &[V4]), &[phantom]);
    assert_eq!(plan.restore, set(&[V4]));
}

#[test]
fn the_file_text_round_trips_and_bad_text_is_named() {
    for rec in [
        record(4242, &[V4, V6], &[V4]),
        record(1, &[], &[V6]),
        record(u32::MAX, &[], &[]),
    ] {
        let text = render(&rec);
        assert_eq!(parse(&text), Ok(rec), "{text}");
    }
    assert_eq!(
        render(&record(4242, &[V4, V6], &[V4])),
        "# tunnelgate forwarding sysctls of one interface (written atomically)\n\
         pid=4242\nstart=42420\nnetns=net:[4026531840]\nnetns_cookie=4096\n\
         ipv4=needed,changed\nipv6=needed\n"
    );
    // A record of an older version has no cookie: it reads back as one without.
    let mut old = record(7, &[V4], &[V4]);
    old.writer.netns_cookie = None;
    let text = render(&old);
    assert!(!text.contains("netns_cookie"), "{text}");
    assert_eq!(parse(&text), Ok(old));
    let e = parse("pid=1\nstart=2\nnetns=n\nnetns_cookie=-1\n")
        .err()
        .unwrap_or_default();
    assert!(e.contains("netns_cookie=-1"), "{e}");
    assert!(parse("pid=1\nstart=2\n").is_err(), "netns missing");
    let e = parse("pid=x\nstart=2\nnetns=n\n").err().unwrap_or_default();
    assert!(e.contains("pid=x"), "{e}");
    let e = parse("pid=1\nstart=2\nnetns=n\nipv4=maybe\n")
        .err()
        .unwrap_or_default();
    assert!(e.contains("maybe"), "{e}");
}

/// One step of the simulation: daemon `i` (of three interfaces) starts needing these
/// families, reloads to a config that needs these (maybe none), stops cleanly, or is killed
/// with -9.
#[derive(Debug, Clone)]
enum Step {
    Start(usize, BTreeSet<Family>),
    Reload(usize, BTreeSet<Family>),
    Stop(usize),
    Kill(usize),
}

fn step() -> impl Strategy<Value = Step> {
    let families = proptest::sample::subsequence(vec![V4, V6], 1..=2)
        .prop_map(|v| v.into_iter().collect::<BTreeSet<_>>());
    prop_oneof![
        (0..3usize, families.clone()).prop_map(|(i, f)| Step::Start(i, f)),
        (
            0..3usize,
            proptest::sample::subsequence(vec![V4, V6], 0..=2)
        )
            .prop_map(|(i, f)| Step::Reload(i, f.into_iter().collect())),
        (0..3usize).prop_map(Step::Stop),
        (0..3usize).prop_map(Step::Kill),
    ]
}

/// One namespace: its sysctls, the record files by interface, the running daemons.
struct World {
    sysctl: BTreeMap<Family, bool>,
    files: BTreeMap<String, ForwardingRecord>,
    running: BTreeMap<usize, (Writer, BTreeSet<Family>)>,
    next_pid: u32,
}

impl World {
    fn name(i: usize) -> String {
        format!("tg{i}")
    }

    fn alive(&self, w: &Writer) -> bool {
        self.running.values().any(|(r, _)| r == w)
    }

    fn others(&self, i: usize) -> Vec<OtherRecord> {
        self.files
            .iter()
            .filter(|(n, _)| **n != Self::name(i))
            .map(|(n, r)| other(n, r.clone(), self.alive(&r.writer)))
            .collect()
    }

    fn start(&mut self, i: usize, needed: BTreeSet<Family>) {
        self.next_pid += 1;
        let me = writer(self.next_pid);
        let mut changed = BTreeSet::new();
        for f in &needed {
            if !self.sysctl[f] {
                self.sysctl.insert(*f, true);
                changed.insert(*f);
            }
        }
        let previous = self
            .files
            .get(&Self::name(i))
            .map(|r| other(&Self::name(i), r.clone(), self.alive(&r.writer)));
        let rec = on_enable(&me, previous.as_ref(), &needed, &changed);
        self.files.insert(Self::name(i), rec);
        self.running.insert(i, (me, needed));
    }

    /// What the executor does on a reload: `EnableForwarding` of the new set when it needs a
    /// family more, then `RestoreForwarding` of the families it no longer needs.
    fn reload(&mut self, i: usize, needed: BTreeSet<Family>) {
        let Some((me, old)) = self.running.get(&i).cloned() else {
            return;
        };
        if !needed.is_subset(&old) {
            let mut changed = BTreeSet::new();
            for f in &needed {
                if !self.sysctl[f] {
                    self.sysctl.insert(*f, true);
                    changed.insert(*f);
                }
            }
            let previous = self
                .files
                .get(&Self::name(i))
                .map(|r| other(&Self::name(i), r.clone(), true));
            let rec = on_enable(&me, previous.as_ref(), &needed, &changed);
            self.files.insert(Self::name(i), rec);
        }
        let released: BTreeSet<Family> = old.difference(&needed).copied().collect();
        if let (false, Some(own)) = (released.is_empty(), self.files.get(&Self::name(i))) {
            let plan = on_release(own, &released, &self.others(i));
            self.apply(i, plan);
        }
        self.running.insert(i, (me, needed));
    }

    fn apply(&mut self, i: usize, plan: StopPlan) {
        for f in &plan.restore {
            self.sysctl.insert(*f, false);
        }
        match plan.own {
            Some(r) => self.files.insert(Self::name(i), r),
            None => self.files.remove(&Self::name(i)),
        };
        for (n, r) in plan.others {
            match r {
                Some(r) => self.files.insert(n, r),
                None => self.files.remove(&n),
            };
        }
    }

    fn stop(&mut self, i: usize) {
        let Some(own) = self.files.get(&Self::name(i)).cloned() else {
            self.running.remove(&i);
            return;
        };
        let plan = on_stop(&own, &self.others(i));
        self.apply(i, plan);
        self.running.remove(&i);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn forwarding_stays_on_while_needed_and_ends_as_it_began(
        initial_v4 in any::<bool>(), initial_v6 in any::<bool>(),
        steps in proptest::collection::vec(step(), 0..24),
    ) {
        let initial = BTreeMap::from([(V4, initial_v4), (V6, initial_v6)]);
        let mut w = World { sysctl: initial.clone(), files: BTreeMap::new(), running: BTreeMap::new(), next_pid: 0 };
        let mut killed: BTreeMap<usize, BTreeSet<Family>> = BTreeMap::new();
        for s in &steps {
            match s {
                Step::Start(i, f) if !w.running.contains_key(i) => {
                    w.start(*i, f.clone());
                    killed.remove(i);
                }
                Step::Reload(i, f) => w.reload(*i, f.clone()),
                Step::Stop(i) if w.running.contains_key(i) => w.stop(*i),
                Step::Kill(i) => {
                    if let Some((_, needed)) = w.running.remove(i) {
                        killed.insert(*i, needed);
                    }
                }
                _ => {}
            }
            for (_, needed) in w.running.values() {
                for f in needed {
                    prop_assert!(w.sysctl[f], "{:?} off under a running daemon after {:?}", f, s);
                }
            }
        }
        // Every daemon stops; a killed one is restarted first (systemd's Restart=), then stops.
        let running: Vec<usize> = w.running.keys().copied().collect();
        for i in running {
            w.stop(i);
        }
        for (i, needed) in killed {
            w.start(i, needed);
            w.stop(i);
        }
        prop_assert_eq!(&w.sysctl, &initial);
        prop_assert!(w.files.is_empty(), "records left: {:?}", w.files);
    }
}
