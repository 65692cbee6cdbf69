;;;; Session values as the text a shared session store keeps: what goes in
;;;; comes back equal, what is outside the whitelist is refused before it is
;;;; written, and no text is read into anything else.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite session-values :in all :description "Session values written and read as text.")
(in-suite session-values)

(defun data-text (data)
  (hunchentoot-recycling-taskmaster::session-data-text data))

(defun data-from-text (text)
  "The values read from TEXT and the reason it was refused, as a list."
  (multiple-value-list (hunchentoot-recycling-taskmaster::session-data-from-text text)))

(defstruct session-values-test-structure slot)

(test session-values.round-trip-equal
  (let ((data `((count . 41) (:user . "ゆき \"quoted\" \\ back")
                (ratio . 2/3) (float . 1.5) (double . 2.5d0) (big . ,(expt 2 130))
                (character . #\λ) (keyword . :admin) (symbol . ht:session-value) (nothing)
                (list . (1 (2 "three") :four)) (dotted . (1 . 2))
                (vector . #(1 "two" #(3))) (empty-string . ""))))
    (is (equalp (list data) (data-from-text (data-text data))))
    (is (eq (cdr (assoc 'symbol (first (data-from-text (data-text data))))) 'ht:session-value)
        "a symbol comes back as the same symbol, package and all")))

(test session-values.refuses-values-outside-the-whitelist
  (dolist (value (list (make-hash-table) (make-session-values-test-structure) (make-symbol "UNINTERNED")
                       #p"/tmp/" (lambda () 1) (make-array 3 :element-type '(unsigned-byte 8))
                       (let ((circular (list 1 2))) (setf (cdr (last circular)) circular) circular)
                       (let ((deep '())) (dotimes (i 200 deep) (setf deep (list deep))))))
    (let ((condition (handler-case (progn (data-text (list (cons 'key value))) nil)
                       (session-value-not-storable (condition) condition))))
      (is (typep condition 'session-value-not-storable) "~S was written" (type-of value))
      (when condition
        (is (eq 'key (hunchentoot-recycling-taskmaster::unstorable-session-key condition)))
        (is (search "cannot be kept" (princ-to-string condition)))))))

(test session-values.reads-only-what-it-writes
  (let ((*package* (find-package '#:cl-user)))
    (dolist (text '("#.(error \"evaluated\")" "((a . #.(+ 1 2)))"
                    "((hunchentoot-recycling-taskmaster-test::key . #S(hunchentoot-recycling-taskmaster-test::session-values-test-structure :slot 1)))"
                    "((hunchentoot-recycling-taskmaster-test::key . #1=(1 . #1#)))"
                    "((no-such-package-here::key . 1))" "((:key . #p\"/tmp/\"))"
                    "((:key . 1)) (:more)" "(:key 1)" "((\"key\" . 1))" "((:key . 1)" ""))
      (destructuring-bind (data &optional reason) (data-from-text text)
        (is (null data) "~S was read as ~S" text data)
        (is (stringp reason) "~S was refused without a reason" text)))))
