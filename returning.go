package outbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"reflect"
	"slices"
	"strings"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/schema"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// What the database did. Events are built from the rows a write actually
// changed, as the database reports them, not from the values the statement
// was given: GORM builds the statement of a create, update or delete of an
// emitting model as usual, but does not run it (outbox:returning_* makes
// it a dry run); outbox:returned_* runs it with every column of the model
// added to its RETURNING clause, hands GORM the columns it asked for
// itself, so that GORM fills the models as it would have, and keeps the
// rest: one stored row per row inserted, updated or deleted.
//
// Each returned row becomes a model value filled from the row: a copy of
// the statement's own model for that row where there is one (found by
// position when every row was written, by conflict target or primary key
// otherwise; the structs it embeds through pointers copied too, so that
// filling it leaves the caller's model as it was), so that fields that
// are not columns (associations) stay as the caller set them, or a fresh
// zero model (writes by condition, creates from maps). Either way its
// columns hold the row as stored: a NULL is what a fresh read gives, not
// what the caller's struct held. A row an
// upsert updated is reported as an update: PostgreSQL says so in
// RETURNING (xmax = 0 for a row the statement inserted); on
// SQLite the plugin reads which of the statement's conflict keys exist
// first, in the same transaction, which SQLite's single writer keeps true
// until the upsert has run.

// returnedRow is one row a write changed, as stored.
type returnedRow struct {
	values   []any // one per column of returned.cols, holders from the fields' value pools
	inserted any   // the inserted flag's holder, where the engine reports one
}

// returned is what a statement's write reported.
type returned struct {
	cols []*schema.Field
	rows []returnedRow
	// existing holds the conflict keys that existed before an upsert ran,
	// where the engine cannot say which rows it inserted (SQLite); nil
	// otherwise.
	existing map[string]bool
	keys     []*schema.Field // the fields of those keys
	// before holds the rows an upsert may update, as they were before it
	// ran, by keyText of keys, where the engine returns the rows an
	// upsert left as they were (MySQL: lockClashingRows; nil elsewhere),
	// and such a row records nothing.
	before map[string]returnedRow
	upsert bool // the statement was an upsert that may update
	// unchanged: the upsert's assignments set every column to itself (how
	// GORM writes DoNothing on MySQL), so a row it did not insert is
	// one it left as it was, and records nothing.
	unchanged bool
	op        Op // the statement's kind
	// unread: the statement ran, but the plugin could not read every row
	// it wrote (a value the field's type refuses to scan, say).
	unread bool
}

// returning makes the statement a dry run for GORM's own write callback,
// so that outbox:returned_* runs it with the plugin's RETURNING columns.
func (p *OutboxPlugin) returning(db *gorm.DB) {
	st := stateOf(db)
	if st == nil || db.Error != nil || db.DryRun {
		return
	}
	st.config = db.Config
	dry := *db.Config
	dry.DryRun = true
	db.Config = &dry
}

// returned runs the statement that GORM built, and records its rows.
func (p *OutboxPlugin) returned(op Op) func(*gorm.DB) {
	return func(db *gorm.DB) {
		st := stateOf(db)
		if st == nil || st.config == nil {
			return
		}
		db.Config, st.config = st.config, nil
		stmt := db.Statement
		if db.Error != nil || stmt.SQL.Len() == 0 {
			return // GORM refused the statement, or it has nothing to write
		}
		d, err := dialect.For(db)
		if err != nil {
			_ = db.AddError(err)
			return
		}
		var r *returned
		st.withModel(stmt, func() { r, err = p.run(db, d, op) })
		if err != nil {
			if r != nil && r.unread {
				st.returned = r // what it wrote must go with the statement
			}
			_ = db.AddError(err)
			return
		}
		st.returned = r
	}
}

// run executes stmt's SQL with the plugin's RETURNING columns.
func (p *OutboxPlugin) run(db *gorm.DB, d dialect.Dialect, op Op) (*returned, error) {
	stmt := db.Statement
	r := &returned{op: op}
	for _, f := range stmt.Schema.Fields {
		if f.DBName != "" && f.Readable {
			r.cols = append(r.cols, f)
		}
	}
	// A soft delete is an UPDATE: what the engine returns, and what is
	// read back, is that of an update.
	kind := op
	if op == OpDelete && strings.HasPrefix(strings.TrimSpace(stmt.SQL.String()), "UPDATE") {
		kind = OpUpdate
	}
	if !d.ReturnsRows(kind == OpUpdate) {
		if (kind == OpUpdate || kind == OpDelete) && len(stmt.Schema.PrimaryFields) == 1 {
			return r, p.lockAndRead(db, r, kind)
		}
		_, upsert := upsertClause(stmt)
		if kind == OpCreate && !upsert {
			if keys, ok := insertKeys(stmt); ok {
				return r, p.insertAndRead(db, r, keys)
			}
		}
		instead := ""
		if upsert {
			instead = " (GORM saves a parent's children as an upsert: Create the parent with Omit(clause.Associations) and the children in a second Create)"
		}
		return nil, fmt.Errorf("%w: %s of %s on %s: the engine cannot return the rows the statement writes; write it otherwise%s, or run it through outbox.WithoutEvents and record events with outbox.Publish",
			ErrUnidentifiedRows, op, stmt.Schema.Name, db.Dialector.Name(), instead)
	}
	var extra strings.Builder
	for i, f := range r.cols {
		if i > 0 {
			extra.WriteString(", ")
		}
		// Qualified: an UPDATE ... FROM has the other table's columns in
		// scope too.
		stmt.QuoteTo(&extra, clause.Column{Table: stmt.Table, Name: f.DBName})
	}
	if op == OpCreate {
		if err := p.prepareUpsert(db, d, r); err != nil {
			return nil, err
		}
		if r.upsert && r.keys == nil {
			extra.WriteString(", " + d.InsertedColumn())
		}
	}

	// GORM's own RETURNING clause, if its statement has one, ends the
	// statement on every engine the plugin supports; the plugin's columns
	// follow GORM's.
	gormReturning, mode := gormReturns(db, op)
	query := stmt.SQL.String()
	if gormReturning {
		query += ", " + extra.String()
	} else {
		query += " RETURNING " + extra.String()
	}
	rows, err := stmt.ConnPool.QueryContext(stmt.Context, query, stmt.Vars...)
	if err != nil {
		return nil, err
	}
	cols, err := rows.Columns()
	if err != nil {
		rows.Close()
		r.unread = true
		return r, err
	}
	hr := &hidingRows{Rows: rows, shown: len(cols) - len(r.cols), r: r}
	if r.upsert && r.keys == nil {
		hr.shown--
	}
	// GORM scans the columns it asked for into the models, as it would
	// have (an update of a value that cannot be addressed would make it
	// panic).
	scanned := false
	switch {
	case !gormReturning:
	case op != OpUpdate:
		gorm.Scan(hr, db, mode)
		scanned = true
	case stmt.ReflectValue.CanAddr():
		dest := stmt.Dest
		stmt.Dest = stmt.ReflectValue.Addr().Interface()
		gorm.Scan(hr, db, mode)
		stmt.Dest = dest
		scanned = true
	}
	if err := hr.drain(); err != nil {
		r.unread = true
		return r, err
	}
	if !scanned {
		db.RowsAffected = int64(len(r.rows))
	}
	if stmt.Result != nil {
		stmt.Result.RowsAffected = db.RowsAffected
	}
	return r, nil
}

// lockAndRead runs an update or a delete on an engine without RETURNING
// for it (MySQL): in the statement's transaction, it first locks the rows
// the statement's WHERE matches (SELECT ... FOR UPDATE, so that no other
// transaction changes which rows those are), then runs the statement, and
// reads the rows as stored: after an update, by primary key; for a delete,
// the rows as they were, read with the lock. kind is what the SQL does
// (a soft delete is an update). A statement with a LIMIT, or one that
// sets the primary key, takes more (lockread.go).
func (p *OutboxPlugin) lockAndRead(db *gorm.DB, r *returned, kind Op) error {
	stmt := db.Statement
	pk := stmt.Schema.PrimaryFields[0]
	query, vars := stmt.SQL.String(), stmt.Vars
	refuse := func(why string) error {
		return fmt.Errorf("%w: %s of %s on %s: %s; run it through outbox.WithoutEvents and record events with outbox.Publish",
			ErrUnidentifiedRows, kind, stmt.Schema.Name, db.Dialector.Name(), why)
	}
	b, cut := cutStatement(stmt)
	if b.limited && !cut {
		return refuse("it has a LIMIT, and the plugin cannot restrict it to the rows it locked")
	}
	var newKey any
	movesKey := false
	if cut && kind == OpUpdate {
		var err error
		if newKey, movesKey, err = b.newKey(stmt); err != nil {
			return refuse(err.Error())
		}
	}
	if err := readRows(db, r, nil); err != nil {
		return err
	}
	if movesKey && len(r.rows) > 1 {
		return refuse(fmt.Sprintf("it sets the primary key of %d rows to one value", len(r.rows)))
	}
	idx := slices.Index(r.cols, pk)
	ids := make([]any, len(r.rows))
	for i, row := range r.rows {
		ids[i] = row.values[idx]
	}
	if b.limited {
		if len(ids) == 0 {
			db.RowsAffected = 0
			return nil
		}
		query, vars = b.onKeys(stmt, ids)
	}
	res, err := stmt.ConnPool.ExecContext(stmt.Context, query, vars...)
	if err != nil {
		return err
	}
	if stmt.Result != nil {
		stmt.Result.Result = res
	}
	if n, err := res.RowsAffected(); err == nil {
		db.RowsAffected = n
	}
	if kind == OpDelete || len(r.rows) == 0 {
		return nil
	}
	if movesKey {
		ids = []any{newKey}
	}
	locked := len(r.rows)
	r.rows = nil
	if err := readRows(db, r, clause.IN{Column: clause.Column{Table: stmt.Table, Name: pk.DBName}, Values: ids}); err != nil {
		return err
	}
	if len(r.rows) != locked {
		return fmt.Errorf("outbox: update of %s: %d of the %d rows it updated are not found by their primary key after it ran", stmt.Schema.Name, locked-len(r.rows), locked)
	}
	return nil
}

// readRows reads, locked, the rows of the statement's table that where
// matches (the statement's own WHERE, ORDER BY and LIMIT when where is
// nil) into r.
func readRows(db *gorm.DB, r *returned, where clause.Expression) error {
	stmt := db.Statement
	sel := &gorm.Statement{DB: db, Table: stmt.Table, TableExpr: stmt.TableExpr, Schema: stmt.Schema, Context: stmt.Context, Clauses: map[string]clause.Clause{}}
	cols := make([]clause.Column, len(r.cols))
	for i, f := range r.cols {
		cols[i] = clause.Column{Table: stmt.Table, Name: f.DBName}
	}
	sel.AddClause(clause.Select{Columns: cols})
	sel.AddClause(clause.From{})
	if where != nil {
		sel.AddClause(clause.Where{Exprs: []clause.Expression{where}})
	} else {
		for _, name := range []string{"WHERE", "ORDER BY", "LIMIT"} {
			if c, ok := stmt.Clauses[name]; ok {
				sel.Clauses[name] = c
			}
		}
	}
	sel.AddClause(clause.Locking{Strength: clause.LockingStrengthUpdate})
	sel.Build("SELECT", "FROM", "WHERE", "ORDER BY", "LIMIT", "FOR")
	rows, err := stmt.ConnPool.QueryContext(stmt.Context, sel.SQL.String(), sel.Vars...)
	if err != nil {
		return err
	}
	return (&hidingRows{Rows: rows, r: r}).drain()
}

// tableSQL returns the statement's table as GORM writes it in the
// statement: its TableExpr, where it has one without variables, or its
// Table quoted. A name with a schema's or database's name before it
// ("otherdb.labels", from a model's TableName or from Table) is whole
// only in TableExpr, quoted ("otherdb"."labels"); Table holds the part
// after the dot.
func tableSQL(stmt *gorm.Statement) string {
	if e := stmt.TableExpr; e != nil && len(e.Vars) == 0 {
		return e.SQL
	}
	return stmt.Quote(stmt.Table)
}

// tableName returns the name of the statement's table, with its schema's
// or database's name before it where GORM was given one
// ("otherdb.labels"): TableExpr's name as GORM quoted it, read back, or
// Table where TableExpr is not one (an alias, say).
func tableName(stmt *gorm.Statement) string {
	e := stmt.TableExpr
	if e == nil || len(e.Vars) > 0 || len(e.SQL) < 2 {
		return stmt.Table
	}
	q := e.SQL[:1] // GORM's dialectors quote each part alike: `a`.`b`, "a"."b"
	parts := strings.Split(e.SQL[1:len(e.SQL)-1], q+"."+q)
	for i, part := range parts {
		parts[i] = strings.ReplaceAll(part, q+q, q)
	}
	if name := strings.Join(parts, "."); stmt.Quote(name) == e.SQL {
		return name
	}
	return stmt.Table
}

// insertKeys tells, before a create runs on an engine without INSERT ...
// RETURNING (MySQL 8), how its rows' primary keys will be known: from the
// models, when every one holds its key (given is true), or from the
// auto-increment counter, when none does. It reports false for anything
// else (rows from maps, composite keys, some keys given and some not),
// which the plugin then refuses.
func insertKeys(stmt *gorm.Statement) (given, ok bool) {
	models := modelsOf(stmt)
	if len(stmt.Schema.PrimaryFields) != 1 || len(models) == 0 {
		return false, false
	}
	pk := stmt.Schema.PrimaryFields[0]
	set := 0
	for _, m := range models {
		if _, zero := pk.ValueOf(stmt.Context, m); !zero {
			set++
		}
	}
	switch {
	case set == len(models):
		return true, true
	case set == 0 && pk.AutoIncrement:
		return false, true
	}
	return false, false
}

// insertAndRead runs a create on an engine without INSERT ... RETURNING
// (MySQL 8) and reads the rows it inserted back by primary key, in the
// statement's transaction, so that each event says what its row holds,
// defaults included. Keys not given are the auto-increment values, which
// InnoDB hands a multi-row INSERT ... VALUES consecutively from
// LAST_INSERT_ID() in every innodb_autoinc_lock_mode (its number of rows
// is known in advance, a "simple insert"; GORM fills keys in the same
// way; a server whose auto_increment_increment is above 1 numbers them
// otherwise, and the read back then fails the create); the plugin sets
// them in the models, as GORM would have.
func (p *OutboxPlugin) insertAndRead(db *gorm.DB, r *returned, given bool) error {
	stmt := db.Statement
	ctx := stmt.Context
	res, err := stmt.ConnPool.ExecContext(ctx, stmt.SQL.String(), stmt.Vars...)
	if err != nil {
		return err
	}
	if stmt.Result != nil {
		stmt.Result.Result = res
	}
	n, err := res.RowsAffected()
	if err != nil {
		return err
	}
	db.RowsAffected = n
	models := modelsOf(stmt)
	if n != int64(len(models)) {
		return fmt.Errorf("outbox: create of %s inserted %d rows of %d", stmt.Schema.Name, n, len(models))
	}
	pk := stmt.Schema.PrimaryFields[0]
	ids := make([]any, len(models))
	var first int64
	if !given {
		if first, err = res.LastInsertId(); err != nil {
			return err
		}
	}
	for i, m := range models {
		if given {
			ids[i], _ = pk.ValueOf(ctx, m)
			continue
		}
		ids[i] = first + int64(i)
		if err := pk.Set(ctx, m, first+int64(i)); err != nil {
			return err
		}
	}
	if err := readRows(db, r, clause.IN{Column: clause.Column{Table: stmt.Table, Name: pk.DBName}, Values: ids}); err != nil {
		return err
	}
	// In the models' order, which is how the events are matched to them.
	keys := []*schema.Field{pk}
	byKey := make(map[string]returnedRow, len(r.rows))
	for _, row := range r.rows {
		m := reflect.New(stmt.Schema.ModelType).Elem()
		r.fill(ctx, m, row)
		byKey[keyText(ctx, keys, m)] = row
	}
	r.rows = r.rows[:0]
	for _, m := range models {
		row, ok := byKey[keyText(ctx, keys, m)]
		if !ok {
			return fmt.Errorf("outbox: create of %s: an inserted row was not found by its key", stmt.Schema.Name)
		}
		r.rows = append(r.rows, row)
	}
	return nil
}

// gormReturns reports whether GORM's own statement has a RETURNING
// clause, and how GORM would scan its rows into the models.
func gormReturns(db *gorm.DB, op Op) (bool, gorm.ScanMode) {
	stmt := db.Statement
	c, ok := stmt.Clauses["RETURNING"]
	if !ok || !slices.Contains(stmt.BuildClauses, "RETURNING") {
		return false, 0
	}
	var mode gorm.ScanMode
	ret, _ := c.Expression.(clause.Returning)
	if len(ret.Columns) > 1 || (len(ret.Columns) == 1 && ret.Columns[0].Name != "*") {
		mode = gorm.ScanUpdate
	}
	if op == OpCreate {
		if oc, ok := upsertClause(stmt); ok {
			if oc.DoNothing {
				mode |= gorm.ScanOnConflictDoNothing
			} else if len(oc.DoUpdates) > 0 || oc.UpdateAll {
				mode |= gorm.ScanUpdate
			}
		}
	}
	return true, mode
}

func upsertClause(stmt *gorm.Statement) (clause.OnConflict, bool) {
	c, ok := stmt.Clauses["ON CONFLICT"]
	if !ok {
		return clause.OnConflict{}, false
	}
	oc, ok := c.Expression.(clause.OnConflict)
	return oc, ok
}

// prepareUpsert finds out, for a create that may update existing rows,
// how the plugin will tell the rows it inserts from those it updates:
// from the engine's inserted flag, or, where the engine has none, by
// reading which of the statement's conflict keys exist before it runs.
func (p *OutboxPlugin) prepareUpsert(db *gorm.DB, d dialect.Dialect, r *returned) error {
	stmt := db.Statement
	oc, ok := upsertClause(stmt)
	if !ok || oc.DoNothing || (len(oc.DoUpdates) == 0 && !oc.UpdateAll) {
		return nil
	}
	r.upsert = true
	r.unchanged = !oc.UpdateAll && selfAssigned(oc.DoUpdates)
	if d.InsertedColumn() != "" {
		return nil
	}
	refuse := func(why string) error {
		return fmt.Errorf("%w: upsert of %s on %s: %s; write the rows one by one, or run the statement through outbox.WithoutEvents and record events with outbox.Publish",
			ErrUnidentifiedRows, stmt.Schema.Name, db.Dialector.Name(), why)
	}
	kr := d.KeyReads()
	columns := oc.Columns
	if len(columns) == 0 && oc.OnConstraint == "" && kr.PrimaryKey {
		for _, f := range stmt.Schema.PrimaryFields {
			columns = append(columns, clause.Column{Name: f.DBName})
		}
	}
	if len(columns) == 0 || oc.OnConstraint != "" {
		return refuse("the plugin needs the conflict columns (clause.OnConflict{Columns: ...}) to tell updated rows from inserted ones")
	}
	for _, c := range columns {
		f := stmt.Schema.LookUpField(c.Name)
		if f == nil || f.DBName == "" {
			return refuse(fmt.Sprintf("the conflict column %q is not a column of the model", c.Name))
		}
		r.keys = append(r.keys, f)
	}
	models := modelsOf(stmt)
	if models == nil {
		return refuse("the rows are not model values")
	}
	conn := plainConn(stmt.ConnPool)
	if kr.UniqueKeys != nil {
		unique, err := kr.UniqueKeys(stmt.Context, conn, tableName(stmt))
		if err != nil {
			return fmt.Errorf("outbox: upsert of %s: %w", stmt.Schema.Name, err)
		}
		return p.lockClashingRows(db, r, unique) // upsert.go
	}
	existing, err := readExistingKeys(stmt.Context, conn, stmt, r.keys, models, d.Bind, kr)
	if err != nil {
		return fmt.Errorf("outbox: upsert of %s: read the existing rows: %w", stmt.Schema.Name, err)
	}
	r.existing = existing
	return nil
}

// selfAssigned reports whether every assignment of an upsert sets a
// column to itself, which changes no row it does not insert.
func selfAssigned(as []clause.Assignment) bool {
	for _, a := range as {
		v, ok := a.Value.(clause.Column)
		if !ok || v.Table == "excluded" || v.Raw || !strings.EqualFold(v.Name, a.Column.Name) {
			return false
		}
	}
	return len(as) > 0
}

// hidingRows hands GORM the columns it asked for, and keeps the plugin's
// columns, which follow them, for each row read.
type hidingRows struct {
	*sql.Rows
	shown   int // the columns GORM asked for
	r       *returned
	pending bool // Next moved to a row that Scan has not read
}

func (h *hidingRows) Columns() ([]string, error) {
	c, err := h.Rows.Columns()
	if err != nil {
		return nil, err
	}
	return c[:h.shown], nil
}

func (h *hidingRows) ColumnTypes() ([]*sql.ColumnType, error) {
	c, err := h.Rows.ColumnTypes()
	if err != nil {
		return nil, err
	}
	return c[:h.shown], nil
}

func (h *hidingRows) Next() bool {
	h.pending = h.Rows.Next()
	return h.pending
}

func (h *hidingRows) Scan(dest ...any) error {
	row := returnedRow{values: make([]any, len(h.r.cols))}
	all := make([]any, 0, len(dest)+len(row.values)+1)
	all = append(all, dest...)
	for i, f := range h.r.cols {
		row.values[i] = f.NewValuePool.Get()
		all = append(all, row.values[i])
	}
	if h.r.upsert && h.r.keys == nil {
		row.inserted = new(any)
		all = append(all, row.inserted)
	}
	if err := h.Rows.Scan(all...); err != nil {
		h.r.unread = true
		return err
	}
	h.pending = false
	h.r.rows = append(h.r.rows, row)
	return nil
}

// drain reads the rows GORM left, then closes them.
func (h *hidingRows) drain() error {
	defer h.Rows.Close()
	for h.pending || h.Next() {
		ignore := make([]any, h.shown)
		for i := range ignore {
			ignore[i] = new(any)
		}
		if err := h.Scan(ignore...); err != nil {
			return err
		}
	}
	if err := h.Rows.Err(); err != nil {
		return err
	}
	return h.Rows.Close()
}

// written is one row a write changed, as a model value filled from the
// row, and what happened to it.
type written struct {
	model reflect.Value // addressable struct of the model type
	op    Op
}

// rowsWritten turns the returned rows into model values, with what
// happened to each.
func (r *returned) rowsWritten(stmt *gorm.Statement) []written {
	op := r.op
	ctx := stmt.Context
	sch := stmt.Schema
	models := modelsOf(stmt)
	fresh := make([]reflect.Value, len(r.rows))
	for i, row := range r.rows {
		fresh[i] = reflect.New(sch.ModelType).Elem()
		r.fill(ctx, fresh[i], row)
	}
	bases := make([]reflect.Value, len(r.rows))
	switch {
	case op == OpCreate && len(models) == len(r.rows):
		copy(bases, models)
	case len(models) > 0:
		keys := sch.PrimaryFields
		if oc, ok := upsertClause(stmt); ok && op == OpCreate && len(oc.Columns) > 0 {
			keys = nil
			for _, c := range oc.Columns {
				if f := sch.LookUpField(c.Name); f != nil && f.DBName != "" {
					keys = append(keys, f)
				}
			}
			if len(keys) != len(oc.Columns) {
				keys = sch.PrimaryFields
			}
		}
		byKey := make(map[string]reflect.Value, len(models))
		for _, m := range models {
			if k, ok := keyOf(ctx, keys, m); ok {
				byKey[k] = m
			}
		}
		for i := range fresh {
			if k, ok := keyOf(ctx, keys, fresh[i]); ok {
				bases[i] = byKey[k]
			}
		}
	}
	out := make([]written, len(r.rows))
	wrote := map[string]returnedRow{} // by key, the rows an upsert wrote so far
	for i, row := range r.rows {
		m := fresh[i]
		if bases[i].IsValid() {
			m = reflect.New(sch.ModelType).Elem()
			m.Set(bases[i])
			r.detach(m)
			r.fill(ctx, m, row)
		}
		out[i] = written{model: m, op: op}
		if op == OpCreate && r.upsert {
			if updated, prev := r.updated(ctx, fresh[i], row, wrote); updated {
				out[i].op = OpUpdate
				if r.unchanged || (r.before != nil && prev != nil && sameValues(*prev, row)) {
					out[i].model = reflect.Value{}
				}
			}
		}
	}
	out = slices.DeleteFunc(out, func(w written) bool { return !w.model.IsValid() })
	for _, row := range r.rows {
		for j, f := range r.cols {
			f.NewValuePool.Put(row.values[j])
		}
	}
	return out
}

// detach gives m, a copy of a caller's model, copies of its own of the
// structs it embeds through a pointer (an anonymous *Stamp, or a pointer
// tagged gorm:"embedded") on the way to a column of r.cols, so that fill
// writes nothing into memory the caller's model points to. GORM marks
// such a step of a field's index path negative (-i-1); a nil pointer is
// left to fill, which sets a new struct.
func (r *returned) detach(m reflect.Value) {
	own := map[uintptr]bool{} // the copies made so far
	for _, f := range r.cols {
		v := m
		for _, i := range f.StructField.Index {
			if i >= 0 {
				v = v.Field(i)
				continue
			}
			v = v.Field(-i - 1)
			if v.IsNil() {
				break
			}
			if !own[v.Pointer()] {
				c := reflect.New(v.Type().Elem())
				c.Elem().Set(v.Elem())
				v.Set(c)
				own[c.Pointer()] = true
			}
			v = v.Elem()
		}
	}
}

// fill sets m's columns from row, so that they hold what a fresh read of
// the row gives, whatever m held before. GORM's Set leaves a field as it
// was for a NULL, so each column is reset to its zero value first: a NULL
// then reads as it does into a new model (the zero value, a nil pointer,
// an invalid sql.Null*; a Scanner is not asked to Scan(nil)).
func (r *returned) fill(ctx context.Context, m reflect.Value, row returnedRow) {
	for j, f := range r.cols {
		f.ReflectValueOf(ctx, m).SetZero()
		_ = f.Set(ctx, m, row.values[j]) // the driver scanned the value into the field's own holder
	}
}

// updated reports whether an upsert updated the row rather than inserted
// it, and the row as it was before, where known. Where the plugin read
// the existing keys first, a row whose key an earlier row of the same
// statement wrote was updated too (a statement that names one key twice
// inserts it, then updates it); written holds those rows by key.
func (r *returned) updated(ctx context.Context, fresh reflect.Value, row returnedRow, written map[string]returnedRow) (bool, *returnedRow) {
	if r.keys != nil {
		if nullKey(ctx, r.keys, fresh) {
			return false, nil // a NULL clashes with no row, not even another NULL
		}
		k := keyText(ctx, r.keys, fresh)
		prev, again := written[k]
		written[k] = row
		if again {
			return true, &prev
		}
		if old, ok := r.before[k]; ok {
			return true, &old
		}
		return r.existing[k], nil
	}
	switch v := (*row.inserted.(*any)).(type) {
	case bool:
		return !v, nil
	case int64:
		return v == 0, nil
	}
	return false, nil
}

// nullKey reports whether one of m's values of fields is NULL: a nil
// pointer, or a Valuer whose value is nil (an invalid sql.Null*).
func nullKey(ctx context.Context, fields []*schema.Field, m reflect.Value) bool {
	for _, f := range fields {
		v, _ := f.ValueOf(ctx, m)
		if valuer, ok := v.(driver.Valuer); ok {
			if dv, err := valuer.Value(); err == nil && dv == nil {
				return true
			}
			continue
		}
		if rv := reflect.ValueOf(v); !rv.IsValid() || (rv.Kind() == reflect.Pointer && rv.IsNil()) {
			return true
		}
	}
	return false
}

// keyOf returns a text key of m's values of fields, and whether there are
// fields and none of the values is zero.
func keyOf(ctx context.Context, fields []*schema.Field, m reflect.Value) (string, bool) {
	if len(fields) == 0 {
		return "", false
	}
	for _, f := range fields {
		if _, zero := f.ValueOf(ctx, m); zero {
			return "", false
		}
	}
	return keyText(ctx, fields, m), true
}

// keyText returns a text key of m's values of fields.
func keyText(ctx context.Context, fields []*schema.Field, m reflect.Value) string {
	var b strings.Builder
	for _, f := range fields {
		v, _ := f.ValueOf(ctx, m)
		fmt.Fprintf(&b, "%v\x00", reflect.Indirect(reflect.ValueOf(v)))
	}
	return b.String()
}

// modelsOf returns the model values a statement holds (its struct, or the
// elements of its slice or array), addressable, or nil when it holds none
// of the model's type (a map, a model of another type).
func modelsOf(stmt *gorm.Statement) []reflect.Value {
	var out []reflect.Value
	eachModel(stmt.ReflectValue, func(m reflect.Value) {
		if m.Type() == stmt.Schema.ModelType {
			out = append(out, m)
		}
	})
	return out
}

// existingChunk is how many rows one read of existing conflict keys names.
const existingChunk = 200

// readExistingKeys reads which of the models' values of keys exist in the
// statement's table, as kr says: with its Lock appended to each read, and
// the keys listed as VALUES or, with RowList, as row constructors. It
// returns them as keyText keys.
func readExistingKeys(ctx context.Context, conn gorm.ConnPool, stmt *gorm.Statement, keys []*schema.Field, models []reflect.Value, bind func(string) string, kr dialect.KeyReads) (map[string]bool, error) {
	var cols strings.Builder
	for i, f := range keys {
		if i > 0 {
			cols.WriteString(", ")
		}
		stmt.QuoteTo(&cols, f.DBName)
	}
	tuple := "(?" + strings.Repeat(", ?", len(keys)-1) + ")"
	values := "VALUES "
	if kr.RowList {
		values = ""
	}
	existing := make(map[string]bool)
	for start := 0; start < len(models); start += existingChunk {
		chunk := models[start:min(start+existingChunk, len(models))]
		args := make([]any, 0, len(chunk)*len(keys))
		for _, m := range chunk {
			for _, f := range keys {
				v, _ := f.ValueOf(ctx, m)
				args = append(args, v)
			}
		}
		query := "SELECT " + cols.String() + " FROM " + tableSQL(stmt) +
			" WHERE (" + cols.String() + ") IN (" + values + tuple + strings.Repeat(", "+tuple, len(chunk)-1) + ")" + kr.Lock
		rows, err := conn.QueryContext(ctx, bind(query), args...)
		if err != nil {
			return nil, err
		}
		for rows.Next() {
			holders := make([]any, len(keys))
			for i, f := range keys {
				holders[i] = f.NewValuePool.Get()
			}
			if err := rows.Scan(holders...); err != nil {
				rows.Close()
				return nil, err
			}
			m := reflect.New(stmt.Schema.ModelType).Elem()
			for i, f := range keys {
				_ = f.Set(ctx, m, holders[i])
				f.NewValuePool.Put(holders[i])
			}
			existing[keyText(ctx, keys, m)] = true
		}
		if err := rows.Err(); err != nil {
			rows.Close()
			return nil, err
		}
		if err := rows.Close(); err != nil {
			return nil, err
		}
	}
	return existing, nil
}
