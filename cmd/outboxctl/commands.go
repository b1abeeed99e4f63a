package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxinspect"
)

func statsCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "stats",
		Short: "Counts by state, the oldest due message's age, the last failure",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			d, done, err := g.dispatcher(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			s, err := d.Stats(cmd.Context())
			if err != nil {
				return err
			}
			return g.printStats(s, time.Now())
		},
	}
}

// listFlags are the filter flags of list and of requeue's dry run.
type listFlags struct {
	states, types                []string
	aggType, aggID               string
	olderThan, newerThan         ageFlag
	limit                        int
	oldestFirst, inSequenceOrder bool
}

func listCmd(g *globals) *cobra.Command {
	var l listFlags
	cmd := &cobra.Command{
		Use:   "list",
		Short: "Messages filtered by state, event type, aggregate and age, newest first",
		Example: `  outboxctl list --db sqlite:./app.db --state failed
  outboxctl list --db postgres://localhost/app --type order.created --older-than 1h --oldest
  outboxctl list --db sqlite:./app.db --aggregate-type order --aggregate-id 42 --sequence-order -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if l.oldestFirst && l.inSequenceOrder {
				return errors.New("list: --oldest and --sequence-order exclude each other")
			}
			for _, s := range l.states {
				switch s {
				case outbox.StatePending, outbox.StateDelivering, outbox.StateDelivered, outbox.StateRetry, outbox.StateFailed:
				default:
					return fmt.Errorf("list: --state %q is none of pending, delivering, delivered, retry, failed", s)
				}
			}
			if l.limit < 1 || l.limit > outboxinspect.MaxMessageLimit {
				return fmt.Errorf("list: --limit %d is not between 1 and %d", l.limit, outboxinspect.MaxMessageLimit)
			}
			f := outboxinspect.MessageFilter{States: l.states, EventTypes: l.types, AggregateType: l.aggType, AggregateID: l.aggID, Limit: l.limit}
			now := time.Now()
			if l.olderThan > 0 {
				f.CreatedBefore = now.Add(-time.Duration(l.olderThan))
			}
			if l.newerThan > 0 {
				f.CreatedAfter = now.Add(-time.Duration(l.newerThan))
			}
			switch {
			case l.oldestFirst:
				f.Order = outboxinspect.OldestFirst
			case l.inSequenceOrder:
				f.Order = outboxinspect.SequenceOrder
			}
			d, done, err := g.dispatcher(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			msgs, err := outboxinspect.New(d).Messages(cmd.Context(), f)
			if err != nil {
				return err
			}
			return g.printMessages(msgs, now)
		},
	}
	fl := cmd.Flags()
	fl.StringSliceVar(&l.states, "state", nil, "keep messages in these states (pending, delivering, delivered, retry, failed); repeat or separate by commas")
	fl.StringSliceVar(&l.types, "type", nil, "keep messages of these event types")
	fl.StringVar(&l.aggType, "aggregate-type", "", "keep messages of this aggregate type")
	fl.StringVar(&l.aggID, "aggregate-id", "", "keep messages of this aggregate id")
	fl.Var(&l.olderThan, "older-than", "keep messages written longer ago than this, as in 30m, 24h or 7d")
	fl.Var(&l.newerThan, "newer-than", "keep messages written within this much time, as in 30m, 24h or 7d")
	fl.IntVar(&l.limit, "limit", outboxinspect.DefaultMessageLimit, "print at most this many messages")
	fl.BoolVar(&l.oldestFirst, "oldest", false, "oldest first instead of newest first")
	fl.BoolVar(&l.inSequenceOrder, "sequence-order", false, "by aggregate and sequence, the order of delivery")
	return cmd
}

func showCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "show EVENT_ID",
		Short:   "One message whole: payload, headers, attempts, last error, lease",
		Example: `  outboxctl show --db sqlite:./app.db 0b6f1c0e-6a1f-4c1e-9d0a-3f1b2c3d4e5f`,
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			d, done, err := g.dispatcher(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			m, err := outboxinspect.New(d).Message(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			return g.printMessage(m, time.Now())
		},
	}
}

// selection is the flags that name dead letters, shared by requeue and
// discard.
type selection struct {
	ids, types   []string
	failedBefore string
	limit        int
	all, dryRun  bool
}

func (sel *selection) flags(cmd *cobra.Command, verb string) {
	fl := cmd.Flags()
	fl.StringSliceVar(&sel.ids, "id", nil, verb+" these event ids; repeat or separate by commas")
	fl.StringSliceVar(&sel.types, "type", nil, verb+" the failed messages of these event types")
	fl.StringVar(&sel.failedBefore, "failed-before", "", verb+" messages that failed before this time (RFC 3339) or this long ago (as in 2h or 7d)")
	fl.IntVar(&sel.limit, "limit", 0, "take at most this many, oldest failure first (default: the dispatcher's sweep limit, 1000)")
	fl.BoolVar(&sel.all, "all", false, verb+" every failed message (up to --limit)")
	fl.BoolVar(&sel.dryRun, "dry-run", false, "print the messages it would take, and change nothing")
}

// filter checks the selection of command name and returns its filter:
// one of --id, --type, --failed-before or --all is required.
func (sel *selection) filter(name string) (outbox.RequeueFilter, error) {
	f := outbox.RequeueFilter{EventIDs: sel.ids, EventTypes: sel.types, Limit: sel.limit}
	if sel.failedBefore != "" {
		t, err := parseBefore(sel.failedBefore, time.Now())
		if err != nil {
			return f, fmt.Errorf("%s: --failed-before: %w", name, err)
		}
		f.FailedBefore = t
	}
	if !sel.all && len(sel.ids) == 0 && len(sel.types) == 0 && f.FailedBefore.IsZero() {
		return f, fmt.Errorf("%s: name what to take with --id, --type or --failed-before, or pass --all", name)
	}
	if sel.limit < 0 {
		return f, fmt.Errorf("%s: --limit %d is negative", name, sel.limit)
	}
	return f, nil
}

// run opens a dispatcher with opts and prints what the selection takes
// (dry run) or takes it with act, printing how many under verb.
func (sel *selection) run(cmd *cobra.Command, g *globals, name, verb string, act func(*outbox.Dispatcher, context.Context, outbox.RequeueFilter) (int, error), opts ...outbox.DispatcherOption) error {
	f, err := sel.filter(name)
	if err != nil {
		return err
	}
	d, done, err := g.dispatcher(cmd.Context(), opts...)
	if err != nil {
		return err
	}
	defer done()
	if sel.dryRun {
		msgs, err := outboxinspect.New(d).RequeueCandidates(cmd.Context(), f)
		if err != nil {
			return err
		}
		return g.printMessages(msgs, time.Now())
	}
	n, err := act(d, cmd.Context(), f)
	if err != nil {
		return err
	}
	return g.printCount(verb, n)
}

func requeueCmd(g *globals) *cobra.Command {
	var sel selection
	cmd := &cobra.Command{
		Use:   "requeue",
		Short: "Dead-lettered (failed) messages back to pending, by id, by type, or failed before a time",
		Long: `requeue moves failed messages back to pending with their attempts reset;
the messages of their aggregates that waited behind them follow. Name what
to move with --id, --type or --failed-before (or --all), and look first
with --dry-run, which prints the messages that would move.`,
		Example: `  outboxctl requeue --db sqlite:./app.db --id 0b6f1c0e-6a1f-4c1e-9d0a-3f1b2c3d4e5f
  outboxctl requeue --db postgres://localhost/app --type order.created --failed-before 2h --dry-run
  outboxctl requeue --db postgres://localhost/app --failed-before 2024-05-01T12:00:00Z`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return sel.run(cmd, g, "requeue", "requeued", (*outbox.Dispatcher).Requeue)
		},
	}
	sel.flags(cmd, "requeue")
	return cmd
}

func discardCmd(g *globals) *cobra.Command {
	var sel selection
	cmd := &cobra.Command{
		Use:   "discard",
		Short: "Take dead-lettered (failed) messages out of delivery for good, by id, by type, or failed before a time",
		Long: `discard takes failed messages out of delivery for good: they are never
requeued nor delivered, and the messages of their aggregates that waited
behind them are delivered next, in order. Each moves to the table
<table>_discarded, which keeps it whole for people to read, and its id is
logged on standard error. Only failed messages are taken. Name what to take with --id, --type or --failed-before
(or --all), and look first with --dry-run, which prints the messages that
would be discarded.`,
		Example: `  outboxctl discard --db sqlite:./app.db --id 0b6f1c0e-6a1f-4c1e-9d0a-3f1b2c3d4e5f
  outboxctl discard --db postgres://localhost/app --type order.legacy --dry-run
  outboxctl discard --db postgres://localhost/app --type order.legacy --failed-before 7d`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// Each discarded event's id is logged (Info) on stderr.
			log := slog.New(slog.NewTextHandler(g.stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
			return sel.run(cmd, g, "discard", "discarded", (*outbox.Dispatcher).Discard, outbox.WithLogger(log))
		},
	}
	sel.flags(cmd, "discard")
	return cmd
}

func purgeCmd(g *globals) *cobra.Command {
	var (
		olderThan ageFlag
		batch     int
		dryRun    bool
	)
	cmd := &cobra.Command{
		Use:   "purge",
		Short: "Delete delivered messages older than an age, in bounded batches",
		Long: `purge deletes delivered messages whose delivery is older than --older-than,
in statements of at most --batch rows, until none is left. It never touches
a message that is not delivered, nor the sequence table. A deleted
message's idempotency key can be written again. --dry-run counts what it
would delete, and deletes nothing.`,
		Example: `  outboxctl purge --db postgres://localhost/app --older-than 7d --batch 5000
  outboxctl purge --db sqlite:./app.db --older-than 168h --dry-run`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if olderThan <= 0 {
				return errors.New("purge: --older-than must be a positive age, as in 168h or 7d")
			}
			if batch < 1 {
				return fmt.Errorf("purge: --batch %d is less than 1", batch)
			}
			age := time.Duration(olderThan)
			d, done, err := g.dispatcher(cmd.Context(), outbox.WithRetention(age), outbox.WithSweepLimit(batch))
			if err != nil {
				return err
			}
			defer done()
			if dryRun {
				n, err := outboxinspect.New(d).PurgeCandidates(cmd.Context(), age)
				if err != nil {
					return err
				}
				return g.printCount("would purge", int(n))
			}
			n, err := d.Cleanup(cmd.Context())
			if err != nil {
				return err
			}
			return g.printCount("purged", n)
		},
	}
	cmd.Flags().Var(&olderThan, "older-than", "delete delivered messages delivered longer ago than this, as in 168h or 7d (required)")
	cmd.Flags().IntVar(&batch, "batch", outbox.DefaultSweepLimit, "delete at most this many rows per statement")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "print how many messages it would delete, and delete nothing")
	return cmd
}

func migrateCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "migrate",
		Short:   "Apply the outbox schema's migrations (creates the tables when missing)",
		Example: `  outboxctl migrate --db sqlite:./app.db`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			db, err := g.open(cmd.Context(), true)
			if err != nil {
				return err
			}
			defer func() {
				if sqlDB, err := db.DB(); err == nil {
					sqlDB.Close()
				}
			}()
			if err := outbox.AutoMigrate(db.WithContext(cmd.Context())); err != nil {
				return err
			}
			fmt.Fprintf(g.stdout, "migrated %s\n", g.table)
			return nil
		},
	}
}

func checkCmd(g *globals) *cobra.Command {
	var (
		o      outboxinspect.CheckOptions
		noLag  bool
		maxDue time.Duration
	)
	cmd := &cobra.Command{
		Use:   "check",
		Short: "Verify the outbox's promises on the live table; exit 2 on a violation",
		Long: `check verifies, on the live table:
  - sequences gapless per aggregate (below the lowest remaining row,
    cleanup may have deleted delivered ones);
  - no delivered message after one of its aggregate that no claim has taken
    since it was written or requeued (a late settle explains the others);
  - no delivering message whose lease ended more than --lease-grace ago;
  - every idempotency key and event id once;
  - the oldest due message younger than --max-due-age.
It prints each violation on a line and exits with status 2 when there is one.

Run it after your own chaos tests (killed dispatchers, restarted databases),
once the dispatchers have drained what they could.`,
		Example: `  outboxctl check --db postgres://localhost/app
  outboxctl check --db sqlite:./app.db --lease-grace 2m --max-due-age 10m -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.LeaseGrace <= 0 {
				return fmt.Errorf("check: --lease-grace %v is not positive", o.LeaseGrace)
			}
			if maxDue <= 0 {
				return fmt.Errorf("check: --max-due-age %v is not positive", maxDue)
			}
			o.MaxDueAge = maxDue
			if noLag {
				o.MaxDueAge = -1
			}
			d, done, err := g.dispatcher(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			vs, err := outboxinspect.New(d).Check(cmd.Context(), o)
			if err != nil {
				return err
			}
			if err := g.printViolations(vs); err != nil {
				return err
			}
			if len(vs) > 0 {
				return fmt.Errorf("%w: %d", errViolations, len(vs))
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.DurationVar(&o.LeaseGrace, "lease-grace", outboxinspect.DefaultCheckLeaseGrace, "how long after its lease ended a delivering message may wait")
	fl.DurationVar(&maxDue, "max-due-age", outboxinspect.DefaultCheckMaxDueAge, "how long the oldest due message may have waited")
	fl.BoolVar(&noLag, "no-lag", false, "skip the due-age check (for a table no dispatcher drains)")
	return cmd
}

// printCount reports how many messages a command moved: "verb N
// message(s)", or in JSON {"verb": N} with the verb in snake_case.
func (g *globals) printCount(verb string, n int) error {
	if g.output == "json" {
		return json.NewEncoder(g.stdout).Encode(map[string]int{strings.ReplaceAll(verb, " ", "_"): n})
	}
	_, err := fmt.Fprintf(g.stdout, "%s %d message(s)\n", verb, n)
	return err
}
