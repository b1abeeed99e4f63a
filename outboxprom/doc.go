// Package outboxprom exposes an outbox's delivery as Prometheus metrics.
//
// Two seams give every signal without touching the dispatcher: a
// [Metrics.Wrap]ped publisher sees each batch the dispatcher hands out, how
// long its publish took and what became of each message, and
// [Metrics.Watch] reads [outbox.Dispatcher.Stats] when Prometheus scrapes,
// for the backlog and the lag.
//
//	m, err := outboxprom.New(prometheus.DefaultRegisterer)
//	d, err := outbox.NewDispatcher(db, m.Wrap(publisher))
//	err = m.Watch(d)
//
// # Metrics
//
// The names, labels and label values below are stable: dashboards and
// alerts are written against them (docs/grafana-dashboard.json and
// docs/alerts.yml in the repository are examples).
//
//	outbox_messages{state}                     gauge: rows by state: pending, delivering, retry, failed
//	outbox_oldest_due_age_seconds              gauge: how long the oldest due row has waited (0 when none is due)
//	outbox_published_total{event_type,outcome} counter: messages handed to the publisher, by outcome:
//	                                           accepted, retry, permanent, not_attempted
//	outbox_publish_duration_seconds            histogram: duration of one Publish call (one batch)
//	outbox_batch_messages                      histogram: messages per batch
//	outbox_commit_to_accept_seconds            histogram: from a message's OccurredAt to its acceptance
//
// The outcome of a message is classified from the publisher's error by the
// dispatcher's own rules: nil accepts the batch; a [*outbox.PartialError]
// gives each message its own outcome; [outbox.ErrNotAttempted] is
// not_attempted, an error marked [outbox.Permanent] is permanent, any other
// error is retry. "permanent" counts what the publisher declared permanent;
// a message dead-lettered because it ran out of attempts is counted as
// retry here (its last attempt failed) and shows, with the permanent ones,
// in outbox_messages{state="failed"}. Rows the dispatcher withholds from
// the publisher (an unreadable row and those after it in its aggregate)
// are not counted, since no publish sees them.
//
// outbox_commit_to_accept_seconds starts at the event's OccurredAt, which
// defaults to the time of the write, so it includes the rest of the
// writing transaction; an event whose OccurredAt the writer set in the past
// shows that much more.
//
// Event types are user data: the first [DefaultMaxEventTypes] distinct
// ones (see [WithMaxEventTypes]) get their own event_type label, and any
// later one is counted under event_type="other".
//
// The gauges come from Stats, which queries the table: a scrape reads it
// at most once per [DefaultStatsCacheFor] (see [WithStatsCacheFor]), so
// that frequent or concurrent scrapes cost one query per interval. When
// Stats fails, the scrape reports the error for the two gauges (the
// registry's handler decides whether the scrape fails); other metrics are
// unaffected. The gauges count the whole table, whichever dispatcher is
// watched: when several processes watch one table, aggregate them across
// instances with max, not sum.
package outboxprom
