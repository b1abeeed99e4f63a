package outbox

import (
	"fmt"
	"reflect"
	"slices"
	"strings"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/schema"
)

// Upserts on MySQL and MariaDB. ON DUPLICATE KEY UPDATE names no conflict
// columns: a row of the statement updates the existing row it clashes
// with on any unique key of the table, the first one the server finds.
// MariaDB's INSERT ... RETURNING returns one row per row of the
// statement, in its order, inserted or updated alike (and a row the
// update left as it was, too). So the plugin tells them apart by primary
// key: before the upsert runs it reads, locked, every row of the table
// that clashes with a row of the statement on any unique key
// (lockClashingRows); a returned row whose primary key is one of those,
// or that of a row returned before it, was updated, any other was
// inserted. The rows as they were tell an update that changed nothing
// (the server wrote nothing, and the plugin records nothing) from one
// that did.

// keepsKey reports whether a, an assignment of the primary key column f
// in an upsert's update, leaves the key as it was: it assigns the value
// the statement inserts (VALUES(col), as GORM's AssignmentColumns does
// for a child's foreign key that is part of its key), and every unique
// key of the table holds f, so that a row clashes only with one whose f
// is that value already.
func keepsKey(a clause.Assignment, f *schema.Field, unique map[string][]string) bool {
	v, ok := a.Value.(clause.Column)
	if !ok || v.Table != "excluded" || v.Raw || !strings.EqualFold(v.Name, f.DBName) {
		return false
	}
	for _, cols := range unique {
		if !slices.Contains(cols, strings.ToLower(f.DBName)) {
			return false
		}
	}
	return true
}

// lockClashingRows prepares an upsert on MySQL for rowsWritten: it reads,
// locked (FOR UPDATE, which under REPEATABLE READ also locks the gaps
// where absent keys would go, so that no other transaction inserts them
// before the upsert runs), the rows of the statement's table that clash
// with a row of the statement on one of unique, the table's unique keys
// (by name, each its sorted lower-case columns). It refuses, before
// anything is written, an upsert whose rows it cannot identify that way.
func (p *OutboxPlugin) lockClashingRows(db *gorm.DB, r *returned, unique map[string][]string) error {
	stmt := db.Statement
	refuse := func(why string) error {
		return fmt.Errorf("%w: upsert of %s on %s: %s; write the rows without the upsert (for a parent with children, Create it with Omit(clause.Associations) and Create the children in a second statement), or run it through outbox.WithoutEvents and record events with outbox.Publish",
			ErrUnidentifiedRows, stmt.Schema.Name, db.Dialector.Name(), why)
	}
	pks := stmt.Schema.PrimaryFields
	if len(pks) == 0 {
		return refuse("the model has no primary key to tell the rows apart")
	}
	if len(unique) == 0 {
		// An InnoDB table has a primary key: the plugin looked for
		// another table than the statement writes.
		return refuse(fmt.Sprintf("the server reports no unique key of the table %s, not even a primary key", tableName(stmt)))
	}
	oc, _ := upsertClause(stmt)
	for _, a := range oc.DoUpdates {
		f := stmt.Schema.LookUpField(a.Column.Name)
		if f == nil || !f.PrimaryKey || selfAssigned([]clause.Assignment{a}) || keepsKey(a, f, unique) {
			continue
		}
		return refuse(fmt.Sprintf("it assigns the primary key column %s, by which the plugin tells the rows apart", f.DBName))
	}
	c, ok := stmt.Clauses["VALUES"]
	values, isValues := c.Expression.(clause.Values)
	if !ok || !isValues {
		return refuse("the statement has no VALUES list")
	}
	at := make(map[string]int, len(values.Columns))
	for i, col := range values.Columns {
		at[strings.ToLower(col.Name)] = i
	}
	// The statement's values of each unique key, key by key, for the rows
	// that may clash on it: not a row whose auto-increment key takes a
	// new value (the column left out, or DEFAULT), which clashes with
	// nothing.
	type keyValues struct {
		cols   []string
		tuples [][]any
	}
	var keys []keyValues
	names := make([]string, 0, len(unique))
	for name := range unique {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		k := keyValues{cols: unique[name]}
		idx := make([]int, len(k.cols))
		omitted := false
		for j, col := range k.cols {
			if strings.Contains(col, "(") {
				return refuse(fmt.Sprintf("its unique key %s indexes %s, which the plugin cannot compare", name, col))
			}
			i, ok := at[col]
			if !ok {
				if f := stmt.Schema.LookUpField(col); f != nil && f.PrimaryKey && f.AutoIncrement {
					omitted = true
					break
				}
				return refuse(fmt.Sprintf("the statement does not write the column %s of the unique key %s, which then takes a value the plugin cannot know", col, name))
			}
			idx[j] = i
		}
		if omitted {
			continue
		}
	rows:
		for _, row := range values.Values {
			tuple := make([]any, len(idx))
			for j, i := range idx {
				if _, expr := row[i].(clause.Expression); expr {
					f := stmt.Schema.LookUpField(k.cols[j])
					if f != nil && f.PrimaryKey && f.AutoIncrement && reflect.DeepEqual(row[i], stmt.DefaultValueOf(f)) {
						continue rows
					}
					return refuse(fmt.Sprintf("the value of %s, in the unique key %s, is an SQL expression", values.Columns[i].Name, name))
				}
				tuple[j] = row[i]
			}
			k.tuples = append(k.tuples, tuple)
		}
		keys = append(keys, k)
	}
	r.before = map[string]returnedRow{}
	r.keys = pks
	var cols strings.Builder
	for i, f := range r.cols {
		if i > 0 {
			cols.WriteString(", ")
		}
		stmt.QuoteTo(&cols, f.DBName)
	}
	conn := plainConn(stmt.ConnPool)
	for _, k := range keys {
		var list strings.Builder
		for j, col := range k.cols {
			if j > 0 {
				list.WriteString(", ")
			}
			stmt.QuoteTo(&list, col)
		}
		tuple := "(?" + strings.Repeat(", ?", len(k.cols)-1) + ")"
		for start := 0; start < len(k.tuples); start += existingChunk {
			chunk := k.tuples[start:min(start+existingChunk, len(k.tuples))]
			args := make([]any, 0, len(chunk)*len(k.cols))
			for _, t := range chunk {
				args = append(args, t...)
			}
			query := "SELECT " + cols.String() + " FROM " + tableSQL(stmt) + " WHERE (" + list.String() + ") IN (" +
				tuple + strings.Repeat(", "+tuple, len(chunk)-1) + ") FOR UPDATE"
			if err := r.readBefore(stmt, conn, query, args); err != nil {
				return err
			}
		}
	}
	return nil
}

// readBefore runs query, a locking read of rows an upsert may update,
// and keeps them in r.before by primary key.
func (r *returned) readBefore(stmt *gorm.Statement, conn gorm.ConnPool, query string, args []any) error {
	rows, err := conn.QueryContext(stmt.Context, query, args...)
	if err != nil {
		return fmt.Errorf("outbox: upsert of %s: read the rows it may update: %w", stmt.Schema.Name, err)
	}
	read := &returned{cols: r.cols}
	if err := (&hidingRows{Rows: rows, r: read}).drain(); err != nil {
		return fmt.Errorf("outbox: upsert of %s: read the rows it may update: %w", stmt.Schema.Name, err)
	}
	for _, row := range read.rows {
		r.before[r.keyOfRow(stmt, row)] = row
	}
	return nil
}

// keyOfRow returns the keyText of row's values of r.keys.
func (r *returned) keyOfRow(stmt *gorm.Statement, row returnedRow) string {
	m := reflect.New(stmt.Schema.ModelType).Elem()
	r.fill(stmt.Context, m, row)
	return keyText(stmt.Context, r.keys, m)
}

// sameValues reports whether two rows of r.cols hold the same values, as
// the driver read them.
func sameValues(a, b returnedRow) bool {
	for i := range a.values {
		if !reflect.DeepEqual(a.values[i], b.values[i]) {
			return false
		}
	}
	return true
}
