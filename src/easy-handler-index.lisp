;;;; Easy handlers found by their path.
;;;;
;;;; Hunchentoot's DISPATCH-EASY-HANDLERS compares the request's path with
;;;; every easy handler's in turn, through a generic reader and a generic
;;;; STRING= each: the time grows with the handlers (3,280 ns for the last
;;;; of 100, against 312 from the index; at 19, in the server, both cost
;;;; 6% of a 0 ms request: bench/profiles/2026-11-29-reply-headers.txt).
;;;; An acceptor of INDEXED-EASY-HANDLERS keeps an index of the list from
;;;; path to the first handler with that path, made once and then only
;;;; read, by every worker without a lock, and answers from it in the one
;;;; case where that is exactly Hunchentoot's answer:
;;;;
;;;; - the next dispatch method is Hunchentoot's on HUNCHENTOOT:EASY-ACCEPTOR,
;;;;   which calls the first handler a dispatcher of *DISPATCH-TABLE* finds;
;;;; - *DISPATCH-TABLE*'s first dispatcher is Hunchentoot's
;;;;   DISPATCH-EASY-HANDLERS, as it was when this library was loaded;
;;;; - the handler found comes before every handler for this acceptor whose
;;;;   path is a predicate or that names a host, which only Hunchentoot's
;;;;   dispatcher can ask;
;;;; - the list, up to the handler found, holds the entries indexed, and
;;;;   the handler's entry its path, acceptor names and host: a list changed
;;;;   in place (DELETE, a new entry spliced in) is seen.  An earlier
;;;;   entry's elements changed in place are not, as nothing in Hunchentoot
;;;;   changes them; comparing them all cost more than the index saved.
;;;;
;;;; Anything else -- no handler for the path, a mixin's method between,
;;;; another table -- is dispatched by the next methods as on Hunchentoot's
;;;; own acceptor.  The index is made anew when DEFINE-EASY-HANDLER (which
;;;; pushes a new entry) or anything else replaces the list.

(in-package #:hunchentoot-recycling-taskmaster)

(defclass indexed-easy-handlers (hunchentoot:acceptor)
  ((easy-handler-index
    :initform nil :accessor acceptor-easy-handler-index
    :documentation "The EASY-HANDLER-INDEX of Hunchentoot's easy handlers
for this acceptor's name, made anew at the first request after they change
(easy-handler-index.lisp).")
   (easy-dispatch-next
    :initform nil :accessor acceptor-easy-dispatch-next
    :documentation "Whether Hunchentoot's HUNCHENTOOT:EASY-ACCEPTOR
method runs next after this class's, a DISPATCH-ANSWER kept while the
generic function's methods stay the same (dispatch-answers.lisp)."))
  (:documentation "Finds a request's easy handler by its path in an index,
where Hunchentoot's DISPATCH-EASY-HANDLERS compares the path with each
handler's in turn, whenever Hunchentoot's HUNCHENTOOT:EASY-ACCEPTOR method
dispatches next and would ask DISPATCH-EASY-HANDLERS first.  Placed just
before HUNCHENTOOT:EASY-ACCEPTOR in the easy parallel acceptors' lists."))

(defvar *hunchentoot-easy-dispatcher* #'hunchentoot:dispatch-easy-handlers
  "Hunchentoot's DISPATCH-EASY-HANDLERS as this library was loaded with it.")

(defstruct (easy-handler-index (:constructor %make-easy-handler-index))
  "Where each path's first easy handler is in one list of easy handlers, for
one acceptor name."
  ;; The list indexed (EASY-HANDLER-ALIST) and the acceptor name.
  (alist nil :read-only t)
  (acceptor-name nil :read-only t)
  ;; The list's entries, in order, and a copy of each as it was.
  (entries #() :type simple-vector :read-only t)
  (copies #() :type simple-vector :read-only t)
  ;; From path to the position of its first entry for this acceptor whose
  ;; path is a string and that names no host.
  (positions nil :type hash-table :read-only t)
  ;; The position of the first entry for this acceptor that only
  ;; Hunchentoot's dispatcher can answer; the length of the list if none.
  (first-unindexed 0 :type fixnum :read-only t))

(defun entry-for-acceptor-p (entry acceptor-name)
  "True when the easy handler ENTRY serves acceptors named ACCEPTOR-NAME."
  (let ((acceptor-names (second entry)))
    (or (eq acceptor-names t) (and (listp acceptor-names) (member acceptor-name acceptor-names :test #'eq)))))

(defun make-easy-handler-index (alist acceptor-name)
  "The EASY-HANDLER-INDEX of the easy handlers ALIST for ACCEPTOR-NAME."
  (let ((positions (make-hash-table :test #'equal))
        (first-unindexed (length alist)))
    (loop for entry in alist
          for position from 0
          when (entry-for-acceptor-p entry acceptor-name)
            do (let ((path (first entry)))
                 (cond ((and (stringp path) (null (fourth entry)))
                        (unless (gethash path positions)
                          (setf (gethash path positions) position)))
                       (t (setf first-unindexed (min first-unindexed position))))))
    (%make-easy-handler-index :alist alist :acceptor-name acceptor-name
                              :entries (coerce alist 'simple-vector)
                              :copies (map 'simple-vector #'copy-list alist)
                              :positions positions :first-unindexed first-unindexed)))

(defun current-easy-handler-index (acceptor)
  "ACCEPTOR's EASY-HANDLER-INDEX of the easy handlers as they are now, kept
in ACCEPTOR while the list and the acceptor's name stay the same (written
only when they change)."
  (let ((kept (acceptor-easy-handler-index acceptor))
        (alist (easy-handler-alist))
        (acceptor-name (hunchentoot:acceptor-name acceptor)))
    (if (and kept
             (eq (easy-handler-index-alist kept) alist)
             (eq (easy-handler-index-acceptor-name kept) acceptor-name))
        kept
        (setf (acceptor-easy-handler-index acceptor) (make-easy-handler-index alist acceptor-name)))))

(defun same-elements-p (list copy)
  "True when the proper lists LIST and COPY have the same elements, by EQ."
  (loop for tail = list then (cdr tail)
        for copy-tail = copy then (cdr copy-tail)
        do (cond ((and (null tail) (null copy-tail)) (return t))
                 ((not (and (consp tail) (consp copy-tail) (eq (car tail) (car copy-tail))))
                  (return nil)))))

(defun indexed-through-p (index position)
  "True when INDEX's list holds, up to POSITION, the entries it held when
indexed, and the entry at POSITION the elements it had."
  (declare (type easy-handler-index index) (type fixnum position) (optimize speed))
  (let ((entries (easy-handler-index-entries index)))
    (and (< position (length entries))
         (loop for tail = (easy-handler-index-alist index) then (cdr tail)
               for index-position of-type fixnum from 0 to position
               always (and (consp tail) (eq (car tail) (svref entries index-position))))
         (same-elements-p (svref entries position) (svref (easy-handler-index-copies index) position)))))

(defun indexed-easy-handler (acceptor request)
  "The name of the easy handler Hunchentoot's DISPATCH-EASY-HANDLERS finds
for REQUEST on ACCEPTOR, when the index can tell (see above); else NIL."
  (let* ((index (current-easy-handler-index acceptor))
         (position (gethash (hunchentoot:script-name request) (easy-handler-index-positions index))))
    (when (and position
               (< position (easy-handler-index-first-unindexed index))
               (indexed-through-p index position))
      (third (svref (easy-handler-index-entries index) position)))))

(defun easy-handlers-dispatched-first-p ()
  "True when *DISPATCH-TABLE*'s first dispatcher is Hunchentoot's
DISPATCH-EASY-HANDLERS, by name or as a function, and it is still the one
this library was loaded with."
  (let ((dispatcher (first hunchentoot:*dispatch-table*)))
    (and (or (eq dispatcher 'hunchentoot:dispatch-easy-handlers)
             (eq dispatcher *hunchentoot-easy-dispatcher*))
         (eq (fdefinition 'hunchentoot:dispatch-easy-handlers) *hunchentoot-easy-dispatcher*))))

(defun easy-acceptor-dispatch-method ()
  "Hunchentoot's ACCEPTOR-DISPATCH-REQUEST method on HUNCHENTOOT:EASY-ACCEPTOR."
  (find-method #'hunchentoot:acceptor-dispatch-request '()
               (list (find-class 'hunchentoot:easy-acceptor) (find-class t))))

(defun indexed-easy-handlers-method ()
  "The ACCEPTOR-DISPATCH-REQUEST method on INDEXED-EASY-HANDLERS."
  (find-method #'hunchentoot:acceptor-dispatch-request '()
               (list (find-class 'indexed-easy-handlers) (find-class t))))

(defun easy-acceptor-method-next-p (acceptor request)
  "True when the method CALL-NEXT-METHOD runs after INDEXED-EASY-HANDLERS's
for ACCEPTOR and REQUEST is Hunchentoot's on HUNCHENTOOT:EASY-ACCEPTOR."
  (eq (first (primary-methods-after (indexed-easy-handlers-method) #'hunchentoot:acceptor-dispatch-request
                                    (list acceptor request)))
      (easy-acceptor-dispatch-method)))

(defun easy-acceptor-dispatches-next-p (acceptor request)
  "EASY-ACCEPTOR-METHOD-NEXT-P, kept in ACCEPTOR while still true."
  (kept-dispatch-answer (acceptor-easy-dispatch-next acceptor) acceptor request #'easy-acceptor-method-next-p))

(defmethod hunchentoot:acceptor-dispatch-request ((acceptor indexed-easy-handlers) request)
  "Call the easy handler found in ACCEPTOR's index, as Hunchentoot's
HUNCHENTOOT:EASY-ACCEPTOR method would call it, when that method is next
and the index can tell (see easy-handler-index.lisp); else dispatch as the
next methods do."
  (let ((handler (and (easy-handlers-dispatched-first-p)
                      (easy-acceptor-dispatches-next-p acceptor request)
                      (indexed-easy-handler acceptor request))))
    (if handler
        (funcall handler)
        (call-next-method))))
