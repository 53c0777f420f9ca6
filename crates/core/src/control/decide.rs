//! The control core's decisions: what is due now and not in flight (addresses, routes,
//! lookups, rules), and how a new peer set becomes a diff. Called by every `handle_*`.

use super::*;

impl Control {
    pub(super) fn rules_needed(&self) -> bool {
        self.mode.installs_host_state()
            && (forwarding_configured(&self.config) || self.health_exposed())
    }

    /// Whether the input guard must keep the tunnel from the health endpoint: it listens
    /// beyond loopback now, or the configuration moves it there (the guard goes in first).
    /// Decided from what is bound as well as from the file: a reload that moves it back to
    /// loopback keeps the guard until the old listener is closed.
    pub(super) fn health_exposed(&self) -> bool {
        !self.config.health.allow_from_tunnel
            && (beyond_loopback(self.health.bound) || beyond_loopback(self.config.health.listen))
    }

    /// Whether any rule of ours may be installed: applied, being applied, left by a failed
    /// apply (iptables applies each family on its own) or by a failed removal.
    pub(super) fn rules_installed(&self) -> bool {
        self.rules.applied.is_some()
            || self.rules.failed.is_some()
            || self.rules.in_flight.is_some()
            || self.rules.removing
            || self.rules.removal_failed
    }

    pub(super) fn desired_rules(&self) -> RuleSet {
        let facts = RuntimeFacts {
            wg_port: self.listen_port,
            health_port: self.health.bound.map(|a| a.port()),
            health_beyond_loopback: self.health_exposed(),
        };
        desired(&self.config, &facts, &self.dns.resolved())
    }

    /// The mark on the WireGuard socket: the configured one, else the one routes chose.
    pub(super) fn effective_fwmark(&self) -> Option<u32> {
        self.fwmark.or(self.routes.applied.fwmark)
    }

    /// Everything that is due now and not in flight: the one place that emits applies.
    pub(super) fn step(&mut self, now: Instant) {
        if self.stopping {
            return;
        }
        self.step_addresses(now);
        self.step_routes(now);
        self.step_resolutions(now);
        self.step_health();
        self.step_rules(now);
        self.step_forwarding(now);
    }

    /// Forwarding found off and not writable is asked for again once its backoff has passed:
    /// someone may have turned it on from outside (`sysctl -w` in the namespace).
    fn step_forwarding(&mut self, now: Instant) {
        let rules = &mut self.rules;
        if rules.forwarding_in_flight > 0
            || rules.forwarding_unavailable.is_empty()
            || !rules.forwarding_retry.may_try(now)
        {
            return;
        }
        let families: BTreeSet<Family> = rules
            .forwarding_unavailable
            .keys()
            .filter(|f| rules.forwarding_requested.contains(f))
            .copied()
            .collect();
        if families.is_empty() {
            rules.forwarding_unavailable.clear();
            return;
        }
        // Not due again until this attempt reports (and fails, maybe, with a new backoff).
        rules.forwarding_retry.at = None;
        rules.forwarding_in_flight += 1;
        self.actions.push_back(Action::EnableForwarding(families));
    }

    /// Moves the health endpoint to the address the configuration names, once it is safe:
    /// beyond loopback only after the installed rules hold the input guard (so no tunnel peer
    /// ever reaches it unguarded); back to loopback (or off) at once, the guard staying until
    /// the old listener is reported closed.
    pub(super) fn step_health(&mut self) {
        let want = self.config.health.listen;
        // Only a file moves it (the drop-in's endpoint stays where `--health` put it).
        if !self.mode.has_config_file()
            || want == self.health.requested
            || self.health.in_flight.is_some()
            || self.health.failed == Some(want)
        {
            return;
        }
        let needs_guard = beyond_loopback(want) && !self.config.health.allow_from_tunnel;
        if needs_guard
            && !self
                .rules
                .applied
                .as_ref()
                .is_some_and(|r| r.input_guard && self.rules.in_flight.is_none())
        {
            return;
        }
        self.health.in_flight = Some(want);
        self.actions.push_back(Action::ServeHealth(want));
    }

    pub(super) fn step_addresses(&mut self, now: Instant) {
        if !self.mode.installs_host_state()
            || self.addresses.in_flight.is_some()
            || !self.addresses.retry.may_try(now)
        {
            return;
        }
        let want: BTreeSet<IpNet> = self.config.interface.addresses.iter().copied().collect();
        let mtu = self.config.interface.mtu;
        if want == self.addresses.applied && Some(mtu) == self.addresses.mtu {
            return;
        }
        if Some(mtu) != self.addresses.mtu {
            self.actions.push_back(Action::SetMtu(mtu));
        }
        let add: Vec<IpNet> = want.difference(&self.addresses.applied).copied().collect();
        let remove: Vec<IpNet> = self.addresses.applied.difference(&want).copied().collect();
        self.actions.push_back(Action::SetAddresses { add, remove });
        self.addresses.in_flight = Some((want, mtu));
    }

    /// The route diff of the networks whose wanted route changed since the last one (never a
    /// walk over every peer's), and the default routes' policy rules and socket mark.
    pub(super) fn step_routes(&mut self, now: Instant) {
        if self.routes.in_flight.is_some() || !self.routes.retry.may_try(now) {
            return;
        }
        let table = routes::default_table(self.fwmark);
        if table != self.routes.default_table {
            // The default routes move to the new mark's table.
            self.routes.default_table = table;
            self.routes.dirty.extend(routes::DEFAULT_ROUTES);
        }
        let [v4, v6] = routes::DEFAULT_ROUTES.map(|net| self.routes.desired.contains_key(&net));
        let want_rules = routes::default_rules(v4, v6, table);
        let want_fwmark = if v4 || v6 { Some(table) } else { self.fwmark };
        if let Some(m) = want_fwmark.filter(|m| Some(*m) != self.socket_mark) {
            self.socket_mark = Some(m);
            self.actions.push_back(Action::SetFwmark {
                mark: m,
                src_valid_mark: v4,
            });
        }
        let applied = &self.routes.applied;
        let mut diff = PlanDiff {
            remove_rules: applied.rules.difference(&want_rules).copied().collect(),
            add_rules: want_rules.difference(&applied.rules).copied().collect(),
            ..PlanDiff::default()
        };
        let nets = std::mem::take(&mut self.routes.dirty);
        crate::cost::charge(nets.len());
        for net in &nets {
            let want =
                (self.routes.desired.contains_key(net)).then(|| routes::route_for(*net, table));
            let installed = applied.routes.range(routes::routes_of(*net));
            diff.remove_routes
                .extend(installed.filter(|r| Some(**r) != want).copied());
            diff.add_routes
                .extend(want.filter(|w| !applied.routes.contains(w)));
        }
        if diff.is_empty() {
            self.routes.applied.fwmark = want_fwmark;
            return;
        }
        self.actions.push_back(Action::ApplyRoutes(diff.clone()));
        self.routes.in_flight = Some(RoutesInFlight {
            diff,
            nets,
            fwmark: want_fwmark,
        });
    }

    pub(super) fn step_resolutions(&mut self, now: Instant) {
        let in_flight =
            self.dns.in_flight() + self.endpoints.values().filter(|e| e.in_flight).count();
        let room = MAX_CONCURRENT_RESOLUTIONS.saturating_sub(in_flight);
        let deadline = now + RESOLVE_TIMEOUT;
        let mut started = 0;
        for (peer, lookup) in self.endpoints.iter_mut() {
            if started >= room {
                break;
            }
            if !lookup.in_flight && lookup.retry.may_try(now) {
                lookup.in_flight = true;
                started += 1;
                self.actions.push_back(Action::Resolve {
                    lookup: Lookup::Endpoint {
                        peer: *peer,
                        host: lookup.host.clone(),
                        port: lookup.port,
                    },
                    deadline,
                });
            }
        }
        for name in self.dns.start_due(now, room - started) {
            self.actions.push_back(Action::Resolve {
                lookup: Lookup::Target(name),
                deadline,
            });
        }
    }

    /// Rules follow the configuration both ways: a set to apply, or (a reload to a config
    /// that needs none) the old ones to remove. Forwarding is asked for before the rules that
    /// need it, and given up once the rules that needed it are gone, so a reload ends where a
    /// fresh start of the new configuration would.
    pub(super) fn step_rules(&mut self, now: Instant) {
        if self.rules.in_flight.is_some() || self.rules.removing || self.rules.checking {
            return;
        }
        let sweep = std::mem::take(&mut self.rules.sweep_pending);
        if !self.rules_needed() {
            if sweep && !self.rules_installed() {
                self.actions.push_back(Action::SweepRules);
            }
            self.step_rule_removal(now);
            return;
        }
        let want = self.desired_rules();
        if self.rules.applied.as_ref() == Some(&want) {
            self.release_forwarding(&forwarding_families(&want));
            return;
        }
        // The same set that just failed waits for its backoff; a different one (a reload,
        // a new answer) may fix the failure, so it is tried at once.
        if self.rules.failed.as_ref() == Some(&want) && !self.rules.retry.may_try(now) {
            return;
        }
        let families = forwarding_families(&want);
        if !families.is_subset(&self.rules.forwarding_requested) {
            self.rules
                .forwarding_requested
                .extend(families.iter().copied());
            self.rules.forwarding_recorded = true;
            self.rules.forwarding_in_flight += 1;
            self.actions.push_back(Action::EnableForwarding(families));
        }
        // A failed apply (iptables applies each family on its own) or a removal leaves the
        // installed state unknown: only a full replace is safe then.
        let known = self.rules.failed.is_none() && !self.rules.removal_failed;
        let installed = self.rules.applied.clone().filter(|_| known);
        self.actions.push_back(Action::ApplyRules {
            set: want.clone(),
            installed,
        });
        self.rules.in_flight = Some(want);
    }

    /// No rules needed: remove whatever of ours may be installed (a failed removal waits for
    /// its backoff), then give up every forwarding family.
    fn step_rule_removal(&mut self, now: Instant) {
        if !self.rules_installed() {
            self.release_forwarding(&BTreeSet::new());
            return;
        }
        if self.rules.removal_failed && !self.rules.retry.may_try(now) {
            return;
        }
        self.rules.removing = true;
        self.actions.push_back(Action::RemoveRules);
    }

    /// Gives up the forwarding families asked for earlier that `needed` no longer has.
    fn release_forwarding(&mut self, needed: &BTreeSet<Family>) {
        let unneeded: BTreeSet<Family> = self
            .rules
            .forwarding_requested
            .difference(needed)
            .copied()
            .collect();
        if unneeded.is_empty() {
            return;
        }
        self.rules
            .forwarding_requested
            .retain(|f| needed.contains(f));
        self.rules
            .forwarding_unavailable
            .retain(|f, _| needed.contains(f));
        self.actions.push_back(Action::RestoreForwarding(unneeded));
    }

    pub(super) fn track_names(&mut self, now: Instant) {
        let users = self.config.fqdn_users();
        let names: Vec<String> = users.keys().cloned().collect();
        self.dns.set_names(&names, now);
        self.names.retain(|n, _| users.contains_key(n));
        for (name, who) in users {
            let view = self.names.entry(name.clone()).or_insert_with(|| NameView {
                name,
                ..NameView::default()
            });
            // A reload may move a name between services or change the readiness policy.
            view.services = who.services;
            view.holds_readiness = who.holds_readiness;
        }
    }

    pub(super) fn target_resolved(
        &mut self,
        name: &str,
        result: Result<Vec<IpAddr>, String>,
        now: Instant,
    ) {
        let error = result.as_ref().err().cloned();
        let outcome = self.dns.on_result(name, result, now);
        let Some(view) = self.names.get_mut(name) else {
            return; // the name left the configuration while it was being resolved
        };
        view.resolutions += 1;
        match outcome {
            Outcome::Changed { old, new } => {
                tracing::info!(name, ?old, ?new, "Name re-resolved");
            }
            Outcome::Unchanged => {}
            Outcome::Failed { retry_in } => {
                view.failures += 1;
                let error = error.as_deref().unwrap_or("no addresses in the answer");
                let retry_in_secs = retry_in.as_secs();
                // What the failure leaves in place: the last good answer, or nothing yet.
                let kept = self.dns.get(name).map_or(0, |s| s.addresses.len());
                if kept == 0 {
                    tracing::warn!(
                        name,
                        error,
                        retry_in_secs,
                        "Resolution failed; the name has no address yet, so its rules wait for the first answer"
                    );
                } else {
                    tracing::warn!(
                        name,
                        error,
                        retry_in_secs,
                        kept,
                        "Resolution failed; keeping the last good addresses"
                    );
                }
            }
        }
        if let Some(state) = self.dns.get(name) {
            view.addresses = state.addresses.clone();
            view.last_error = state.last_error.clone();
            if state.failures == 0 {
                view.last_resolved = Some(now);
            }
        }
    }

    pub(super) fn endpoint_resolved(
        &mut self,
        peer: PublicKey,
        host: &str,
        port: u16,
        result: Result<Vec<IpAddr>, String>,
        now: Instant,
    ) {
        let Some(lookup) = self.endpoints.get_mut(&peer) else {
            return;
        };
        if lookup.host != host || lookup.port != port {
            return; // the configured endpoint changed while this lookup ran
        }
        lookup.in_flight = false;
        match result.map(|a| a.first().copied()) {
            Ok(Some(ip)) => {
                self.endpoints.remove(&peer);
                if let Some(spec) = self.peers.get(&peer) {
                    self.actions.push_back(Action::UpdatePeers(PeerChanges {
                        private_key: None,
                        upsert: vec![PeerUpsert {
                            public_key: peer,
                            spec: spec.clone(),
                            endpoint: Some(SocketAddr::new(ip, port)),
                        }],
                        remove: Vec::new(),
                    }));
                }
            }
            Ok(None) => lookup
                .retry
                .failed("no addresses in the answer".into(), now),
            Err(e) => {
                tracing::warn!(host, error = %e, "Cannot resolve peer endpoint; retrying, and waiting for the peer to connect");
                lookup.retry.failed(e, now);
            }
        }
    }
}

/// The families that need IP forwarding for `set`.
pub(super) fn forwarding_families(set: &RuleSet) -> BTreeSet<Family> {
    let mut out: BTreeSet<Family> = set
        .ingress
        .iter()
        .map(|i| i.family)
        .chain(set.egress.iter().map(|e| e.family))
        .collect();
    out.extend(set.router.networks.iter().map(Family::of_net));
    if set.router.exit_node {
        out.extend(Family::ALL);
    }
    out
}
