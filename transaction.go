package outbox

import (
	"database/sql"
	"reflect"
	"sync"
	"sync/atomic"

	"gorm.io/gorm"
)

// Transaction runs fc in a transaction of db, exactly as db.Transaction
// does (the same commit, rollback, savepoints and error), and wakes the
// dispatchers once it has committed, if the model writes and [Publish]
// calls of fc recorded events. It fails with [ErrPluginNotRegistered],
// before fc runs, when the outbox plugin is not registered on db.
//
// Use it instead of db.Transaction for transactions that record events,
// when several of them may run at once. Under db.Transaction the plugin
// cannot see the commit, so on PostgreSQL each such transaction asks for a
// notification at its own commit, and PostgreSQL makes transactions that
// notify commit one at a time (see [WithNotify]). Under Transaction the
// plugin sees the commit: overlapping transactions leave the notification
// to one sent after their commits, as GORM's per-statement transactions
// do, and commit side by side. The dispatchers of this process are woken
// after the commit, not before it.
//
// That holds for the statements that run on fc's tx and on the chains and
// sessions of it that keep its statement's settings and connection, and
// for Publish on the tx that GORM hands a model's hooks. A statement on a
// new session (gorm.Session with NewDB, as GORM uses for association
// saves and for the statements of hooks), on a session that wraps the
// connection anew (PrepareStmt) or on another connection (tx.Connection)
// writes its events as under db.Transaction: no wake-up is lost, but the
// transaction notifies at its own commit.
//
// Called on a db that is already in a transaction, Transaction is
// db.Transaction (a savepoint): the commit it would see is not the one
// that makes the events visible. Its writes are then those of the
// enclosing transaction: counted with the enclosing Transaction if there
// is one, and notifying as under db.Transaction otherwise.
func Transaction(db *gorm.DB, fc func(tx *gorm.DB) error, opts ...*sql.TxOptions) error {
	p, err := pluginOf(db)
	if err != nil {
		return err
	}
	if _, inTx := db.Statement.ConnPool.(gorm.TxCommitter); inTx {
		return db.Transaction(fc, opts...)
	}
	w := &txWrites{p: p}
	defer w.end()
	// A session of its own, so that the setting stays off db's statement
	// (db.Set would store it there when db is a chain).
	err = db.Session(&gorm.Session{}).Set(txWritesKey, w).Transaction(func(tx *gorm.DB) error {
		w.conn = tx.Statement.ConnPool // before any statement of fc's
		return fc(tx)
	}, opts...)
	if err != nil {
		return err
	}
	w.committed()
	return nil
}

// txWritesKey is the setting under which the statements of a Transaction
// find its txWrites.
const txWritesKey = "outbox:transaction"

// txWrites is what the plugin learns about the event writes of a
// transaction whose commit it sees: a Transaction's, a statement's own
// (GORM's default one, or the one the plugin opens), Publish's own. Its
// lock is never held while a statement runs: a write that waits in the
// database must not keep the Transaction's other statements (or those of
// a transaction that fc runs on another connection) from starting.
type txWrites struct {
	p     *OutboxPlugin
	conn  gorm.ConnPool // a Transaction's connection, set before fc runs
	ended atomic.Bool   // the transaction is over: its statements write as any others

	mu       sync.Mutex
	counted  bool      // counted in OutboxPlugin.ownInFlight
	notifier *notifier // sends the notification after the commit, if any
	pending  bool      // a write left the notification to the notifier
	wrote    bool      // a write stored events
}

// txWritesOf returns the Transaction of p that db's statement runs in, or
// nil: the statement must carry the setting, and run on the Transaction's
// own connection while the Transaction lasts.
func txWritesOf(db *gorm.DB, p *OutboxPlugin) *txWrites {
	v, _ := db.Get(txWritesKey)
	w, _ := v.(*txWrites)
	if w == nil || w.p != p || w.ended.Load() || !sameConn(w.conn, db.Statement.ConnPool) {
		return nil
	}
	return w
}

// sameConn reports whether a and b are one connection (pool, transaction
// or prepared-statement wrapper); connections of a type that cannot be
// compared are taken to differ.
func sameConn(a, b gorm.ConnPool) bool {
	if a == nil || b == nil || reflect.TypeOf(a) != reflect.TypeOf(b) || !reflect.ValueOf(a).Comparable() {
		return false
	}
	return a == b
}

// write runs store, which writes events in w's transaction, and tells it
// whether to ask the engine to notify at the commit, as for a transaction
// whose commit the plugin sees (see wake.go). Each write decides for
// itself: a notification asked for in a savepoint is dropped if the
// savepoint rolls back.
func (w *txWrites) write(db *gorm.DB, store func(notify bool) (notified bool, err error)) error {
	w.mu.Lock()
	if !w.counted {
		w.counted = true
		w.p.ownInFlight.Add(1)
		w.notifier = w.p.notifierFor(db)
	}
	n := w.notifier
	w.mu.Unlock()

	notified, err := store(w.p.notifyInside(n))
	// A failed write may have stored some events: a wake-up that finds
	// nothing costs less than one missed.
	w.mu.Lock()
	w.wrote = true
	w.pending = w.pending || !notified
	w.mu.Unlock()
	return err
}

// committed wakes the dispatchers after the transaction committed: this
// process's directly, the others through the notifier unless every write
// asked for a notification at the commit.
func (w *txWrites) committed() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.wrote {
		w.p.committed(w.notifier, !w.pending)
	}
}

// end takes the transaction out of ownInFlight once it has ended.
func (w *txWrites) end() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.ended.Store(true)
	if w.counted {
		w.counted = false
		w.p.ownInFlight.Add(-1)
	}
}
